#!/usr/bin/env bash
# The quality run (python3 -m bench.quality) on both fixtures at once, sharing the GPUs: the standard library's code and its
# prose (docstrings, pydoc's topics), whose next-token distributions differ in entropy, so that every methods table
# has a peaked and a flat fixture. Each fixture's work folder is /tmp/q-FIXTURE, its JSON and log under $RESULTS;
# the eval reports of both (small JSON files, stores left out) are packed into $RESULTS/FIXTURE-reports.tar.gz.
#
#   RESULTS=/tmp/r bash bench/quality/fixtures.sh --modes dflash2,dspark-topk --temperature 1 --set ...
set -u
RESULTS=${RESULTS:?set RESULTS to the folder for the results}
for fixture in code prose; do
    python3 -m bench.quality --work "/tmp/q-$fixture" --out "$RESULTS/$fixture/quality.json" "$@" \
        --set "fixture=$fixture" > "$RESULTS/$fixture.log" 2>&1 &
done
wait
status=$?
for fixture in code prose; do
    (cd "/tmp/q-$fixture" && find . -name '*.json' -not -path '*shards*' -not -path '*/checkpoints/*' |
        tar czf "$RESULTS/$fixture-reports.tar.gz" -T -)
done
exit $status
