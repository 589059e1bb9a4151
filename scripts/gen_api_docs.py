"""Write docs/api.md, the API reference, from the docstrings of dgc_horovod's public names.

Usage: ``python scripts/gen_api_docs.py [OUTPUT]`` (default docs/api.md; ``make docs``).
Covers the ``__all__`` of dgc_horovod.core, dgc_horovod.summary, dgc_horovod.adapter (the
methods both DGC compressors inherit), dgc_horovod.torch and
dgc_horovod.tensorflow (standard library ``inspect`` only). The output depends only on the
source, so tests/test_docs.py can check that the committed file is up to date.
"""
import importlib
import inspect
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULES = ["dgc_horovod.core", "dgc_horovod.summary", "dgc_horovod.adapter", "dgc_horovod.torch",
           "dgc_horovod.tensorflow", "dgc_horovod.tensorflow.elastic"]


def _doc(obj):
    return inspect.cleandoc(obj.__doc__) if obj.__doc__ else "*(no docstring)*"


def _signature(name, obj):
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return name
    return name + sig


def _block(text):
    # Docstrings are reST-flavoured plain text: keep their layout in an indented literal block
    # so that nothing in them is taken for Markdown.
    return "\n".join(("    " + line) if line else "" for line in text.splitlines())


def _own_members(cls):
    """Public methods and properties defined by ``cls`` itself (not inherited), in source order."""
    out = []
    for name, member in cls.__dict__.items():
        if name.startswith("_") and name != "__init__":
            continue
        if isinstance(member, property):
            out.append((name, "property", member))
        elif isinstance(member, (staticmethod, classmethod)):
            out.append((name, "method", member.__func__))
        elif inspect.isfunction(member) and name != "__init__":
            out.append((name, "method", member))
    return out


def document(module_name):
    mod = importlib.import_module(module_name)
    lines = [f"## `{module_name}`", "", _block(_doc(mod)), ""]
    for name in mod.__all__:
        obj = getattr(mod, name)
        qual = f"{module_name}.{name}"
        if inspect.isclass(obj):
            lines += [f"### class `{_signature(qual, obj)}`", "", _block(_doc(obj)), ""]
            for mname, kind, member in _own_members(obj):
                if kind == "property":
                    head = f"#### property `{name}.{mname}`"
                    doc = _doc(member) if member.__doc__ else "*(no docstring)*"
                else:
                    head = f"#### `{_signature(name + '.' + mname, member)}`"
                    doc = _doc(member)
                lines += [head, "", _block(doc), ""]
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            lines += [f"### `{_signature(qual, obj)}`", "", _block(_doc(obj)), ""]
        else:
            lines += [f"### `{qual}`", "", f"    {obj!r}", ""]
    return lines


def render():
    sys.path.insert(0, ROOT)
    lines = ["# API reference", "",
             "Generated from the docstrings by `scripts/gen_api_docs.py` (`make docs`); do not "
             "edit by hand. See the README for a guided tour and `docs/dgc_pipeline.png` for a "
             "picture of one step.", ""]
    lines.append("Modules: " + ", ".join(f"`{m}`" for m in MODULES))
    lines.append("")
    for m in MODULES:
        lines += document(m)
    return "\n".join(lines).rstrip() + "\n"


def main(argv):
    out = argv[1] if len(argv) > 1 else os.path.join(ROOT, "docs", "api.md")
    text = render()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        f.write(text)
    print(f"wrote {out} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main(sys.argv)
