"""Gradient shapes of real models, derived from their architectures (no framework needed).

- ResNet-50 (He et al. 2016, torchvision layout): 161 tensors, 25,557,032 parameters.
- A DeepSpeech-like model (Amodei et al. 2016 style: 2 conv layers, 5 bidirectional GRU layers of
  800 units per direction, fully connected output over 29 characters).
- The paper's PTB language model: 2-layer LSTM, 1500 hidden units, 10,000-word vocabulary, tied
  sizes for the input embedding and the output projection (Lin et al. 2018, §4.2).
"""
import math

__all__ = ["resnet50", "deepspeech_like", "lstm_lm", "mnist_cnn", "MODELS"]


def resnet50(num_classes=1000):
    """[(name, shape)] of ResNet-50's parameters, in registration order."""
    out = [("conv1.weight", (64, 3, 7, 7)), ("bn1.weight", (64,)), ("bn1.bias", (64,))]
    inplanes = 64
    for li, (planes, blocks, stride) in enumerate([(64, 3, 1), (128, 4, 2), (256, 6, 2),
                                                   (512, 3, 2)], start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}."
            out += [(p + "conv1.weight", (planes, inplanes, 1, 1)), (p + "bn1.weight", (planes,)),
                    (p + "bn1.bias", (planes,)),
                    (p + "conv2.weight", (planes, planes, 3, 3)), (p + "bn2.weight", (planes,)),
                    (p + "bn2.bias", (planes,)),
                    (p + "conv3.weight", (planes * 4, planes, 1, 1)),
                    (p + "bn3.weight", (planes * 4,)), (p + "bn3.bias", (planes * 4,))]
            if b == 0 and (stride != 1 or inplanes != planes * 4):
                out += [(p + "downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                        (p + "downsample.1.weight", (planes * 4,)),
                        (p + "downsample.1.bias", (planes * 4,))]
            inplanes = planes * 4
    out += [("fc.weight", (num_classes, 2048)), ("fc.bias", (num_classes,))]
    return out


def deepspeech_like(hidden=800, layers=5, features=161, chars=29):
    out = [("conv1.weight", (32, 1, 41, 11)), ("conv1.bias", (32,)),
           ("conv2.weight", (32, 32, 21, 11)), ("conv2.bias", (32,))]
    rnn_in = 32 * math.ceil(math.ceil(features / 2) / 2)
    for i in range(layers):
        din = rnn_in if i == 0 else 2 * hidden
        for d in ("fwd", "bwd"):
            out += [(f"gru{i}.{d}.w_ih", (3 * hidden, din)), (f"gru{i}.{d}.w_hh", (3 * hidden, hidden)),
                    (f"gru{i}.{d}.b_ih", (3 * hidden,)), (f"gru{i}.{d}.b_hh", (3 * hidden,))]
    out += [("fc.weight", (chars, 2 * hidden)), ("fc.bias", (chars,))]
    return out


def lstm_lm(vocab=10000, hidden=1500, layers=2):
    out = [("embedding.weight", (vocab, hidden))]
    for i in range(layers):
        out += [(f"lstm.weight_ih_l{i}", (4 * hidden, hidden)),
                (f"lstm.weight_hh_l{i}", (4 * hidden, hidden)),
                (f"lstm.bias_ih_l{i}", (4 * hidden,)), (f"lstm.bias_hh_l{i}", (4 * hidden,))]
    out += [("decoder.weight", (vocab, hidden)), ("decoder.bias", (vocab,))]
    return out


def mnist_cnn():
    """The examples' MNIST CNN (examples/tf_model.py, pytorch_mnist.py's Net), Keras's shapes."""
    return [("conv1/kernel", (5, 5, 1, 32)), ("conv1/bias", (32,)),
            ("conv2/kernel", (5, 5, 32, 64)), ("conv2/bias", (64,)),
            ("fc1/kernel", (3136, 256)), ("fc1/bias", (256,)),
            ("fc2/kernel", (256, 10)), ("fc2/bias", (10,))]


MODELS = {"resnet50": resnet50, "deepspeech_like": deepspeech_like, "lstm_lm": lstm_lm,
          "mnist_cnn": mnist_cnn}

if __name__ == "__main__":
    for name, fn in MODELS.items():
        shapes = fn()
        n = sum(math.prod(s) for _, s in shapes)
        print(f"{name}: {len(shapes)} tensors, {n:,} parameters, {4 * n / 2**20:.1f} MiB fp32")
