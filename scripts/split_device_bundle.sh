#!/usr/bin/env bash
# Halve the device bundle's parts (.device-bundle/pNN -> .device-bundle/hNNa, hNNb): a device call carries the
# working tree with its parts, at most 64 MiB in all, and the tracked tree (mostly eval/results) has outgrown the
# room beside a 40 MiB part. Same payload and checksum; the stage.sh of ../shared/device assembles the halves in name
# order. Then carry .device-bundle/h00a, h00b, ... one per call: bash .device-bundle/hNNx/stage.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.device-bundle"
parts=(p[0-9][0-9])
n=$(( ${#parts[@]} * 2 ))
for p in "${parts[@]}"; do
  read -r i _ sum < "$p/manifest"
  size=$(stat -c %s "$p/chunk"); half=$(( (size + 1) / 2 ))
  for x in a b; do
    d="h$i$x"; rm -rf "$d"; mkdir -p "$d"; cp "$p/stage.sh" "$d/stage.sh"
    printf '%s %s %s\n' "$i$x" "$n" "$sum" > "$d/manifest"
  done
  head -c "$half" "$p/chunk" > "h${i}a/chunk"
  tail -c +"$((half + 1))" "$p/chunk" > "h${i}b/chunk"
done
du -sh h* | tr '\n' ' '; echo
echo "$n halves: carry .device-bundle/h00a .. one per call, back to back."
