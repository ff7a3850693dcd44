# Sourced by scripts/test.sh: `with_lane LABEL COMMAND...` runs COMMAND once one of this
# machine's test lanes is free, and holds the lane until COMMAND has ended, and any process it
# left behind that kept the lane's descriptor (a shell's background job does; Python's
# subprocess closes it, and the servers and browsers the tests start end with their tests). The lanes are counted per machine and user, not per copy of the
# suite: a second `make test` beside the first (another clone, a contributor's second branch)
# waits for lanes instead of running out of memory. One copy's four pytest runs at once peaked
# at 17.1 to 19.6 GiB of 24 in fresh clones (fc29 to fc34: about 4.9 GiB a run), so two copies'
# eight runs at once need about 38 GiB, and this machine has no swap: the kernel's OOM killer
# would end a server or a browser mid-test. A lane is 5.5 GiB of the machine's memory (the
# rest is the system's): 4 lanes on 24 GiB. KT_TEST_LANES=N sets the count (1: one run at a
# time). Where flock(1) is missing, nothing waits.

KT_LANE_MIB=5632
KT_LANE_DIR="${TMPDIR:-/tmp}/kontext-trainer-test-lanes-$(id -u)"

lane_count() {
    if [[ -n "${KT_TEST_LANES:-}" ]]; then
        echo "$KT_TEST_LANES"
    else
        awk -v lane="$KT_LANE_MIB" '/^MemTotal:/ {n = int($2 / 1024 / lane); print (n < 1 ? 1 : n)}' /proc/meminfo
    fi
}

with_lane() {  # label, then a command
    local label="$1" lanes lane fd waited=0 status
    shift
    if ! command -v flock >/dev/null; then
        "$@"
        return
    fi
    lanes=$(lane_count)
    mkdir -p "$KT_LANE_DIR"
    while :; do
        for ((lane = 0; lane < lanes; lane++)); do
            exec {fd}>>"$KT_LANE_DIR/lane-$lane"
            if flock -n "$fd"; then
                ((waited > 0)) && echo "[test] $label: lane $lane came free after $waited s"
                "$@"  # inherits the locked descriptor
                status=$?
                exec {fd}>&-
                return $status
            fi
            exec {fd}>&-
        done
        ((waited == 0)) && echo "[test] $label waits for a lane: all $lanes of this machine's are busy" \
            "(another copy of the suite runs; KT_TEST_LANES sets the count)"
        sleep 2
        ((waited += 2))
    done
}
