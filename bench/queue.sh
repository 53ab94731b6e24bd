#!/usr/bin/env bash
# A queue of benchmark commands on the GPU machine, run one after another in the background, so that a session's
# whole plan runs across device calls of at most 10 minutes each. The runner starts a process session of its own
# (setsid): the device kills what a call leaves running in its own session when the call returns.
#
#   bash bench/queue.sh start PLAN [NAME ...]
#                                      # PLAN: lines `NAME<TAB>COMMAND` (# comments and blank lines skipped);
#                                      # with NAMEs, only those lines (in the plan's order; a name the plan
#                                      # lacks is refused before anything starts);
#                                      # returns at once; each COMMAND runs in a copy of the repository
#                                      # (/tmp/queue/repo) after bench/device_setup.sh, its output in
#                                      # /tmp/queue/NAME.log (QUEUE_DIR)
#   bash bench/queue.sh poll OUT [S]   # waits up to S seconds (default 0) for the queue to end, then: which
#                                      # commands ended (exit status) and the running one's last lines;
#                                      # packs /tmp/queue (logs, each command's files under /tmp/queue/NAME/) into
#                                      # OUT/queue.tar.gz: one file, as a call brings back at most 8; and the
#                                      # Triton cache ($TRITON_CACHE_DIR) into OUT/triton.tar.xz, to keep as
#                                      # .device-cache/triton.tar.xz: bench/device_setup.sh unpacks it on the
#                                      # next machine, which then skips 2-3 minutes of compiling fla's kernels
#
# A command writes its files to $RESULTS (/tmp/queue/NAME), not to a call's $OUT, which only lives for one call.
# Poll before each call ends: what the machine holds is lost when it goes back.
set -u
QUEUE=${QUEUE_DIR:-/tmp/queue}
SETUP=${QUEUE_SETUP:-bench/device_setup.sh}  # tests set another

# The plan's lines (comments and blanks dropped), only those of the given names when any are given.
select_lines() {
    local plan=$1 lines name
    shift
    lines=$(grep -v '^\s*\(#\|$\)' "$plan")
    [ $# -eq 0 ] && { printf '%s\n' "$lines"; return 0; }
    for name in "$@"; do
        cut -f1 <<< "$lines" | grep -qxF -- "$name" ||
            { echo "no line $name in $plan; its lines: $(cut -f1 <<< "$lines" | paste -sd ' ')" >&2; return 2; }
    done
    awk -F '\t' -v names="$*" 'BEGIN { split(names, wanted, " "); for (i in wanted) keep[wanted[i]] } $1 in keep' <<< "$lines"
}

start() {
    local plan=$1 lines
    shift
    [ -f "$plan" ] || { echo "no plan file $plan" >&2; return 2; }
    [ -e "$QUEUE/started" ] && { echo "a queue already runs here ($QUEUE); poll it" >&2; return 2; }
    lines=$(select_lines "$plan" "$@") || return 2
    mkdir -p "$QUEUE" && printf '%s\n' "$lines" > "$QUEUE/plan" && date -u +%FT%TZ > "$QUEUE/started"
    # The commands run in a copy of the tree: a later device call syncs the working tree anew under them.
    mkdir -p "$QUEUE/repo" && tar cf - --exclude=./.git --exclude=./.venv --exclude=./.smoke . | tar xf - -C "$QUEUE/repo"
    # exec: no subshell stays behind holding the caller's stdout until the queue ends
    (cd "$QUEUE/repo" && exec setsid nohup bash bench/queue.sh run > "$QUEUE/queue.log" 2>&1 < /dev/null) &
    echo "queue started: $(grep -c . "$QUEUE/plan") commands ($(cut -f1 "$QUEUE/plan" | paste -sd ' ')), logs in $QUEUE"
}

run() {
    # shellcheck disable=SC1090
    if ! source "$SETUP"; then
        echo "$(date -u +%T) setup failed ($SETUP): queue stopped" >> "$QUEUE/status"
        return 1
    fi
    while IFS=$'\t' read -r name command; do
        case "$name" in '' | \#*) continue ;; esac
        export RESULTS="$QUEUE/$name"
        mkdir -p "$RESULTS"
        echo "$(date -u +%T) start $name: $command" >> "$QUEUE/status"
        bash -c "$command" > "$QUEUE/$name.log" 2>&1
        local rc=$?
        echo "$(date -u +%T) end $name: exit $rc" >> "$QUEUE/status"
    done < "$QUEUE/plan"
    echo "$(date -u +%T) queue done" >> "$QUEUE/status"
}

poll() {
    local out=$1 deadline=$((SECONDS + ${2:-0}))
    [ -f "$QUEUE/started" ] || { echo "nothing queued here yet ($QUEUE)"; return 0; }
    # A call's wait ends with the queue, not at a fixed sleep: device time is counted while the machine is held.
    while [ $SECONDS -lt $deadline ] && ! grep -qs "queue done\|queue stopped" "$QUEUE/status"; do sleep 1; done
    [ -f "$QUEUE/status" ] || { echo "the queue's setup still runs ($QUEUE)"; return 0; }
    cat "$QUEUE/status"
    local current
    current=$(tail -n 1 "$QUEUE/status" | sed -n 's/^.* start \([^:]*\):.*$/\1/p')
    [ -n "$current" ] && { echo "--- $current, last lines:"; tail -n 5 "$QUEUE/$current.log"; }
    mkdir -p "$out" && tar czf "$out/queue.tar.gz" -C "$QUEUE" --exclude=./repo .
    local triton=${TRITON_CACHE_DIR:-/tmp/triton}
    if [ -n "$(ls -A "$triton" 2>/dev/null)" ]; then  # one folder inside, as device_setup.sh strips it
        tar -C "$(dirname "$triton")" -I 'xz -T0' -cf "$out/triton.tar.xz" "$(basename "$triton")"
    fi
}

case "${1:-}" in
    start) shift; start "${1:?give the plan file}" "${@:2}" ;;
    run) run ;;
    poll) poll "${2:?give the folder to copy the results to}" "${3:-0}" ;;
    *) echo "usage: bash bench/queue.sh start PLAN [NAME ...] | poll OUT [WAIT_SECONDS]" >&2; exit 2 ;;
esac
