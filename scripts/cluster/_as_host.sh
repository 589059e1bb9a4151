#!/bin/sh
# _as_host.sh NAME CMD...: set the host name (in a UTS namespace made by `unshare --uts`), run CMD.
name="$1"; shift
hostname "$name" && exec "$@"
