#!/usr/bin/env bash
# The device tool returns at most 8 files from $OUT: pack everything under $OUT into one
# $OUT/bundle.tgz (run last in a device command; unpack here with tar xzf).
set -eu
OUT="${OUT:-$PWD/gpu_out}"
tmp=$(mktemp /tmp/afdep-bundle.XXXXXX.tgz)
tar czf "$tmp" -C "$OUT" .
find "$OUT" -mindepth 1 -delete
mv "$tmp" "$OUT/bundle.tgz"
ls -la "$OUT/bundle.tgz"
