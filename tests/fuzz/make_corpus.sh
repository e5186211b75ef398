#!/usr/bin/env bash
# Writes the seed corpus of the fuzz targets into tests/fuzz/corpus/<target>/seed-* from the
# text-format requests below (protoc --encode) and the input layouts the targets document.
# Deterministic; run it after changing a seed or an input layout, and commit the result.
# Inputs kept from fuzzing runs (corpus/<target>/regression-*) are not touched.
set -euo pipefail
cd "$(dirname "$(readlink -f "$0")")"
root=../..
corpus=corpus
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# encode MESSAGE TEXT: the binary protobuf of gradsync.v1.MESSAGE on stdout.
encode() {
  protoc -I "$root/proto" --encode="gradsync.v1.$1" gradsync/v1/gradsync.proto \
    gradsync/v1/store.proto <<<"$2"
}

# --- op_request_fuzzer: one v1::OpRequest. Buffers of the target's session: 1 float32 64 B,
# 2 untyped 37 B, 3 int8 3 B, 4 float64 24 B, 5 untyped 0 B, 6 bfloat16 10 B.
dir=$corpus/op_request_fuzzer
mkdir -p "$dir"
rm -f "$dir"/seed-*
op() { encode OpRequest "$2" >"$dir/seed-$1"; }
op all_reduce 'kind: ALL_REDUCE reduce_op: SUM dtype: FLOAT32 input { buffer_id: 1 count: 16 }'
op all_reduce_segments 'kind: ALL_REDUCE reduce_op: MAX dtype: FLOAT32 group: "0" timeout_ms: 50
  input { buffer_id: 1 count: 4 } input { buffer_id: 1 byte_offset: 32 count: 8 }
  input { buffer_id: 2 byte_offset: 4 count: 8 }'
op broadcast 'kind: BROADCAST dtype: BFLOAT16 root: 0 name: "w" input { buffer_id: 6 count: 5 }'
op all_gather 'kind: ALL_GATHER dtype: INT8 input { buffer_id: 3 count: 1 }
  output { buffer_id: 3 byte_offset: 2 count: 1 }'
op reduce_scatter 'kind: REDUCE_SCATTER reduce_op: MEAN dtype: FLOAT64 group: "world"
  input { buffer_id: 4 count: 1 } output { buffer_id: 4 byte_offset: 16 count: 1 }'
op barrier 'kind: BARRIER name: "step"'
op out_of_bounds 'kind: ALL_REDUCE reduce_op: SUM dtype: FLOAT32 input { buffer_id: 1 count: 17 }'
op empty_buffer 'kind: ALL_REDUCE reduce_op: MIN dtype: UINT8 input { buffer_id: 5 count: 0 }'

# --- store_request_fuzzer: calls [kind][length][request]. Kinds as in the target's enum.
dir=$corpus/store_request_fuzzer
mkdir -p "$dir"
rm -f "$dir"/seed-*
# call KIND MESSAGE TEXT: one call appended to $work/script.
call() {
  encode "$2" "$3" >"$work/payload"
  python3 -c 'import sys; p = open(sys.argv[2], "rb").read(); assert len(p) < 256
sys.stdout.buffer.write(bytes([int(sys.argv[1]), len(p)]) + p)' "$1" "$work/payload" \
    >>"$work/script"
}
script() { mv "$work/script" "$dir/seed-$1"; }
set_=0 add=1 cas=2 del=3 list=4 packlist=5 peek=6 wait_now=7 wait_later=8 cancel=9 deljob=10
call $set_ SetRequest 'job: "j" key: "k" value: "v"'
call $peek GetRequest 'job: "j" key: "k"'
call $add AddRequest 'job: "j" key: "c" delta: 5'
call $add AddRequest 'job: "j" key: "c" delta: -7'
call $cas CompareSetRequest 'job: "j" key: "k" expected: "v" desired: "w"'
call $cas CompareSetRequest 'job: "j" key: "n" expect_absent: true desired: "1"'
call $list ListRequest 'job: "j"'
call $del DeleteRequest 'job: "j" key: "k"'
call $list ListRequest 'job: "j" prefix: "c"'
script basic
call $wait_later WaitRequest 'job: "r" keys: "a" keys: "b"'
call $wait_later WaitRequest 'job: "r" keys: "b"'
call $set_ SetRequest 'job: "r" key: "a" value: "1"'
call $set_ SetRequest 'job: "r" key: "b" value: "2"'
call $wait_now WaitRequest 'job: "r" keys: "a" keys: "z"'
call $wait_later WaitRequest 'job: "r" keys: "z"'
call $cancel GetRequest 'job: "x"'
call $deljob GetRequest 'job: "r"'
script waits
call $packlist SetPackListRequest 'job: "p" group: "0,1" pack_list {
  packs { indices: 0 indices: 1 shapes { shape: 2 dtype: FLOAT32 } shapes { shape: 3 dtype: FLOAT32 }
          dtype: FLOAT32 bytes: 20 }
  threshold_bytes: 16 }'
call $peek GetRequest 'job: "p" key: "_gradsync/packlist/0,1"'
call $set_ SetRequest 'job: "p" key: "_gradsync/packlist/0,1" value: "x"'
call $del DeleteRequest 'job: "p" key: "_gradsync/x"'
script pack_list
for k in 1 2 3 4 5 6 7 8 9; do call $set_ SetRequest "job: \"j\" key: \"k$k\" value: \"$k\""; done
for j in a b c d e; do call $add AddRequest "job: \"$j\" key: \"n\" delta: 9223372036854775807"; done
call $add AddRequest 'job: "a" key: "n" delta: 1'
script limits
call $set_ SetRequest 'job: "bad/job" key: "k"'
call $set_ SetRequest 'job: "j" key: ""'
call $wait_now WaitRequest 'job: "j"'
call $cas CompareSetRequest 'job: "j" key: "k" expected: "v" expect_absent: true'
script invalid

# --- doorbell_fuzzer: a 56-byte prefix (header XORs, completions to write, ring indices),
# then ring bytes from the request tail's position on. Records: a uint64 length, the
# TrainerRequest, padding to 8 bytes; a length of ~0 skips to the ring's start.
dir=$corpus/doorbell_fuzzer
mkdir -p "$dir"
rm -f "$dir"/seed-*
encode TrainerRequest 'tag: 7 op { kind: ALL_REDUCE reduce_op: SUM dtype: FLOAT32
  input { buffer_id: 1 count: 16 } }' >"$work/op"
encode TrainerRequest 'tag: 8 op { kind: BARRIER }' >"$work/barrier"
encode TrainerRequest 'tag: 9 deregister_buffer { buffer_id: 1 }' >"$work/not_op"
# ring NAME COMPLETIONS COMPLETION_HEAD COMPLETION_TAIL TAIL SKIP HEADER_XOR RECORD...
# SKIP > 0 puts a skip marker SKIP bytes before the ring's end and the records at its start.
ring() {
  python3 - "$dir/seed-$1" "${@:2}" <<'EOF'
import struct, sys
out, completions, chead, ctail, tail, skip, xor, *records = sys.argv[1:]
ring_bytes = 4 << 20
body = b""
for r in records:
    data = open(r, "rb").read()
    body += struct.pack("<Q", len(data)) + data + b"\0" * (-len(data) % 8)
tail, skip = int(tail), int(skip)
if skip:
    tail = ring_bytes - skip + (tail // ring_bytes) * ring_bytes
    body = struct.pack("<Q", 2**64 - 1) + b"\0" * (skip - 8) + body
head = tail + len(body)
prefix = struct.pack("<IIQIIQQQQ", int(xor), 0, 0, 0, int(completions), head, tail,
                     int(chead), int(ctail))
open(out, "wb").write(prefix + body)
EOF
}
ring one_op 1 0 0 0 0 0 "$work/op"
ring two_ops 2 3 1 64 0 0 "$work/op" "$work/barrier"
ring not_an_op 0 0 0 0 0 0 "$work/not_op"
ring wrapped 1 0 0 0 16 0 "$work/barrier"
ring wrapped_later 3 1030 6 $((12 << 20)) 64 0 "$work/op"
ring empty 4 0 0 0 0 0
ring completion_ring_full 2 2048 1024 0 0 0 "$work/barrier"
ring bad_magic 0 0 0 0 0 1 "$work/op"
du -sh "$corpus"
