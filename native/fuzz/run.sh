#!/usr/bin/env bash
# Coverage-guided fuzzing of the native readers with libFuzzer (issue 26), offline:
#   apt-get install libfuzzer-19-dev      # the runtime (Debian); no crates, no nightly toolchain
#   native/fuzz/run.sh vm 600             # target (vm | zipdir), seconds [, extra libFuzzer flags]
# Instrumentation is stable rustc's SanitizerCoverage pass (what cargo-fuzz asks for, minus ASan,
# which needs nightly -- safe Rust gives the memory safety ASan would check). Seeds: the
# fixtures' data.pkl records and zip files, and the hostile builders' outputs (seeds.py).
# Crashes land in native/fuzz/artifacts/<target>/; the corpus grows in native/fuzz/corpus/<target>/.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
target="${1:?target: vm or zipdir}"
seconds="${2:-300}"
shift $(( $# > 2 ? 2 : $# ))
libdir="${LIBFUZZER_DIR:-$(dirname "$(ls /usr/lib/llvm-*/lib/libFuzzer.a | tail -1)")}"
python="${PYTHON:-$here/../../.venv/bin/python}"
cd "$here"
"$python" seeds.py                      # table.txt and the seed corpora
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
 -Cllvm-args=-sanitizer-coverage-trace-compares -Cforce-frame-pointers"
# libFuzzer (its main) is linked into the target binary only, not into the crate's cdylib
cargo rustc --release --offline --bin "$target" --target-dir target -- \
  -Clink-arg=-L"$libdir" -Clink-arg=-Wl,--whole-archive -Clink-arg=-lFuzzer -Clink-arg=-Wl,--no-whole-archive \
  -Clink-arg=-lstdc++
mkdir -p "corpus/$target" "artifacts/$target"
exec "target/release/$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -artifact_prefix="artifacts/$target/" "$@" "corpus/$target" "seeds/$target"
