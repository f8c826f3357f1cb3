#!/bin/sh
# The offloadd image's entrypoint (/usr/local/bin/offloadd-entrypoint): with no arguments, or
# with `serve ...`, it runs
#     offloadd serve --config "$OFFLOADD_CONFIG" ...
# in place of itself (exec), so the daemon is the container's main process and gets the
# kubelet's SIGTERM directly: it drains its copies (server.drain_seconds), removes its
# socket and exits 0, keeping the arena and the journal for the next pod (warm restart).
#
# Environment (the image sets each to the path the DaemonSet mounts there; a test or another
# runtime may point them elsewhere):
#   OFFLOADD_CONFIG    the settings file, the ConfigMap's offloadd.toml
#                      (default /etc/offloadd/offloadd.toml)
#   RUNTIME_DIRECTORY  the socket directory engine pods mount (default /run/offloadd): the
#                      default control socket is $RUNTIME_DIRECTORY/offloadd.sock
#   STATE_DIRECTORY    the commit journal and its key, kept across restarts
#                      (default /var/lib/offloadd)
#   OFFLOADD_<SECTION>__<KEY>  any setting, over the file's (see systemd/offloadd.toml)
# Both directories must belong to the daemon's user (the DaemonSet's init container makes
# them so); the daemon refuses one that another user could write.
#
# `check-config ...` and `status ...` get the same --config; any other arguments run
# `offloadd ARGS` as they are (e.g. `demo --endpoint ipc:///run/offloadd/offloadd.sock`).
set -eu

: "${OFFLOADD_CONFIG:=/etc/offloadd/offloadd.toml}"
: "${RUNTIME_DIRECTORY:=/run/offloadd}"
: "${STATE_DIRECTORY:=/var/lib/offloadd}"
export OFFLOADD_CONFIG RUNTIME_DIRECTORY STATE_DIRECTORY

# As the unit's UMask=: what the daemon creates is never open to others, and the ranks'
# group may connect to its sockets.
umask 0007

if [ "$#" -eq 0 ]; then
    set -- serve
fi

case "$1" in
serve)
    shift
    for dir in "$RUNTIME_DIRECTORY" "$STATE_DIRECTORY"; do
        if [ -d "$dir" ] && [ ! -O "$dir" ] && [ "$(id -u)" -ne 0 ]; then
            # The daemon refuses it too, naming the directory; this says what to change.
            echo "offloadd-entrypoint: $dir is not owned by uid $(id -u), the daemon's user:" \
                "chown it (the DaemonSet's init container does) or mount another one" >&2
        fi
    done
    exec offloadd serve --config "$OFFLOADD_CONFIG" "$@"
    ;;
check-config | status)
    command=$1
    shift
    exec offloadd "$command" --config "$OFFLOADD_CONFIG" "$@"
    ;;
*)
    exec offloadd "$@"
    ;;
esac
