"""The CNN of the TensorFlow examples (the same architecture as ``pytorch_mnist.py``'s ``Net``)."""
import tensorflow as tf

__all__ = ["make_model"]


def make_model():
    """conv5x5(32) - pool - conv5x5(64) - pool - fc(3136->256) - fc(256->10)."""
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28, 1)),
        layers.Conv2D(32, 5, padding="same", activation="relu", name="conv1"),
        layers.MaxPool2D(2),
        layers.Conv2D(64, 5, padding="same", activation="relu", name="conv2"),
        layers.MaxPool2D(2),
        layers.Flatten(),
        layers.Dense(256, activation="relu", name="fc1"),
        layers.Dense(10, name="fc2"),
    ], name="mnist_cnn")
