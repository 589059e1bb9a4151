"""Collect this machine's pip configuration into a directory, for a Docker build to mount.

    python3 scripts/docker/host_pkg_config.py DIR [--mount /run/host-pkg-config]

Reads what `pip config list` reports (configuration files and PIP_* environment variables; the
later scope wins: global, user, site, then the environment) and writes DIR/pip.conf with the same
settings, the local files and folders they name copied into DIR (hard links where possible) and
their paths rewritten to where the build mounts DIR (--mount):

* cert, client-cert, constraint, requirement: the file (e.g. a CA bundle that pip needs behind a
  TLS-inspecting proxy);
* find-links: each local folder or file (e.g. a wheel not on the index); URLs stay;
* index-url, extra-index-url: http(s) URLs stay; file:// indexes are left out (they are whole
  local mirrors; the build then uses the other indexes) and listed on stderr.

Nothing to carry (no pip configuration at all): writes nothing and exits 3, so that the build
runs without it. docker/Dockerfile mounts the result only while scripts/install.sh runs: none of it
ends up in the image. Used by scripts/docker/test.sh (make docker-test).
"""
import argparse
import configparser
import os
import re
import shutil
import subprocess
import sys
from urllib.parse import urlparse

FILE_KEYS = ("cert", "client-cert", "constraint", "requirement")
LINE = re.compile(r"^(?P<scope>[^.]*)\.(?P<key>[^=]+)='(?P<value>.*)'$")
ORDER = {"global": 0, "user": 1, "site": 2, ":env:": 3}


def pip_settings(python):
    """{key: value} as pip sees it (later scopes override earlier ones)."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True).stdout
    found = []
    for line in out.splitlines():
        m = LINE.match(line.strip())
        if m and m["key"] != "config-file":     # PIP_CONFIG_FILE: its settings are listed
            found.append((ORDER.get(m["scope"], 1), m["key"], m["value"]))
    return {key: value for _, key, value in sorted(found, key=lambda t: t[0])}


def copy_tree(src, dst):
    """Hard-link src (file or folder) to dst, copying where links are not possible."""
    def link(s, d):
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)
    if os.path.isdir(src):
        shutil.copytree(src, dst, copy_function=link, symlinks=False)
    else:
        link(os.path.realpath(src), dst)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--mount", default="/run/host-pkg-config")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args()
    settings = pip_settings(args.python)
    if not settings:
        print("host-pkg-config: no pip configuration on this machine: nothing to carry",
              file=sys.stderr)
        return 3
    os.makedirs(args.dir, exist_ok=True)
    conf, n_links, notes = {}, 0, []
    for key, value in settings.items():
        if key in FILE_KEYS:
            if not os.path.isfile(value):
                notes.append(f"{key}: {value} does not exist, left out")
                continue
            name = f"{key}{os.path.splitext(value)[1] or '.txt'}"
            copy_tree(value, os.path.join(args.dir, name))
            conf[key] = f"{args.mount}/{name}"
        elif key == "find-links":
            kept = []
            for entry in value.split():
                path = entry[len("file://"):] if entry.startswith("file://") else entry
                if urlparse(entry).scheme in ("http", "https"):
                    kept.append(entry)
                elif os.path.exists(path):
                    n_links += 1
                    name = f"find-links-{n_links}"
                    copy_tree(path, os.path.join(args.dir, name))
                    kept.append(f"{args.mount}/{name}")
                else:
                    notes.append(f"find-links: {entry} does not exist, left out")
            if kept:
                conf[key] = " ".join(kept)
        elif key in ("index-url", "extra-index-url"):
            kept = [u for u in value.split() if urlparse(u).scheme in ("http", "https")]
            notes += [f"{key}: {u} (a local index) left out" for u in value.split()
                      if u not in kept]
            if kept:
                conf[key] = " ".join(kept)
        else:
            conf[key] = value
    parser = configparser.ConfigParser(interpolation=None)
    parser["global"] = conf
    with open(os.path.join(args.dir, "pip.conf"), "w") as f:
        parser.write(f)
    for note in notes:
        print(f"host-pkg-config: {note}", file=sys.stderr)
    print(f"host-pkg-config: {', '.join(sorted(conf))} -> {args.dir}/pip.conf", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
