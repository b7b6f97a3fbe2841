#!/usr/bin/env bash
# The core install has no torch: in a fresh venv with `pip install .` (click, safetensors, numpy),
# torch must not be importable, every torch-free command must work on the committed fixtures,
# and what needs torch must say so in one line with exit 2.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
rm -rf .venv-notorch
python3 -m venv .venv-notorch
# shellcheck disable=SC1091
. .venv-notorch/bin/activate
# ... and with no cargo on PATH: the native core is not built, the install still succeeds (no
# error) and the pure-Python engine runs
no_cargo_path=$(echo "$PATH" | tr ':' '\n' | while read -r dir; do [ -x "$dir/cargo" ] || echo "$dir"; done | paste -sd:)
PATH=$no_cargo_path CKPTFIX_REQUIRE_NATIVE=0 python -m pip install --quiet .
case "$(ckptfix --version)" in
    *"(python engine)") echo "smoke: installed without cargo: the python engine runs" ;;
    *) echo "smoke: without cargo, ckptfix --version says: $(ckptfix --version)" >&2; exit 1 ;;
esac
if (cd / && python -c "import torch") 2>/dev/null; then
    echo "smoke: torch is importable in the torch-free venv" >&2
    exit 1
fi
echo "smoke: torch is not importable here (as intended)"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # never the checkout: the installed package is what runs
fx=$repo/fixtures

# expect CODE ckptfix ARGS...: run it, show it, and fail unless it exits CODE
expect() {
    local want=$1
    shift
    echo "+ $*"
    set +e
    "$@"
    local got=$?
    set -e
    if [ "$got" != "$want" ]; then
        echo "smoke: '$*' exited $got, expected $want" >&2
        exit 1
    fi
}
# the hint names the install this machine needs (the CPU build where no NVIDIA driver is found)
NEEDS_TORCH="ckptfix: error: $(python -c 'from ckptfix.errors import NEEDS_TORCH; print(NEEDS_TORCH)')"
case "$NEEDS_TORCH" in
    "ckptfix: error: needs torch: pip install "*) ;;
    *) echo "smoke: unexpected torch hint: $NEEDS_TORCH" >&2; exit 1 ;;
esac
needs_torch() {
    echo "+ $* (needs torch)"
    set +e
    local err
    err=$("$@" 2>&1 >/dev/null)
    local got=$?
    set -e
    if [ "$got" != 2 ] || [ "$err" != "$NEEDS_TORCH" ]; then
        echo "smoke: '$*' exited $got with: $err (expected exit 2 and: $NEEDS_TORCH)" >&2
        exit 1
    fi
}

expect 0 ckptfix --version
expect 0 ckptfix inspect "$fx/ddp_cpu_tinynet.pth"
expect 0 ckptfix inspect "$fx/legacy_dataparallel_tinynet.pth" --json
expect 0 ckptfix scan "$fx/bare_tinynet.pth" "$fx/lightning_tinynet.ckpt" "$fx/legacy_dataparallel_tinynet.pth"
expect 1 ckptfix scan "$fx/torchscript_tinynet.pt"  # its pickle names code: dangerous
expect 0 ckptfix verify "$fx"/*.pth "$fx"/*.ckpt

# the three formats: torch zip, safetensors, shards (a folder with an index)
expect 0 ckptfix convert "$fx/ddp_cpu_tinynet.pth" ddp.safetensors
expect 0 ckptfix convert ddp.safetensors ddp_shards/ --max-shard-size 300B
expect 0 ckptfix convert ddp_shards/ ddp.pth
expect 0 ckptfix diff "$fx/ddp_cpu_tinynet.pth" ddp.pth
expect 0 ckptfix diff ddp_shards/ ddp.safetensors
expect 0 ckptfix verify ddp_shards/ ddp.safetensors ddp.pth --expect-prefix module.
for src in "$fx/ddp_cpu_tinynet.pth" ddp.safetensors ddp_shards/; do
    name=$(basename "$src" | tr . _)
    expect 0 ckptfix strip-module "$src" "$name-bare.safetensors"
    expect 0 ckptfix add-module "$name-bare.safetensors" "$name-twice.pth" --prefix wrapped.
    expect 0 ckptfix rename "$src" "$name-renamed.pth" --rule '^module\.fc\.=>module.head.'
    expect 0 ckptfix convert "$src" "$name-some/" --drop '*num_batches_tracked' --max-shard-size 300B
    expect 0 ckptfix diff "$src" "$name-bare.safetensors" --strip-prefix module.
    expect 0 ckptfix verify "$name-bare.safetensors" --expect-prefix none
done
expect 0 ckptfix remap "$fx/ddp_cpu_tinynet.pth" gpu.pth --map-location cuda:0
expect 0 ckptfix verify gpu.pth --expect-device cuda:0
expect 0 ckptfix prune "$fx/lightning_tinynet.ckpt" pruned.ckpt --drop epoch
expect 0 ckptfix convert "$fx/lightning_tinynet.ckpt" weights.safetensors --select state_dict --strip-prefix model.
expect 0 ckptfix strip-module "$fx/legacy_dataparallel_tinynet.pth" legacy.safetensors
# --dtype runs in numpy; diff measures the rounding (exit 1), and accepts it within a tolerance
expect 0 ckptfix convert weights.safetensors bf16.safetensors --dtype bf16
expect 0 ckptfix convert bf16.safetensors back.pth --dtype float32
expect 1 ckptfix diff weights.safetensors back.pth
expect 0 ckptfix diff weights.safetensors back.pth --rtol 1e-2 --atol 1e-2
mkdir release
expect 0 ckptfix publish "$fx/lightning_tinynet.ckpt" release/ --name tinynet
expect 0 ckptfix publish "$fx/lightning_tinynet.ckpt" release/ --name tinynet --format pth
expect 0 ckptfix verify release/ --expect-prefix none --expect-device cpu
# DCP folders are written by ckptfix's own emitter, and read back, without torch
expect 0 ckptfix convert "$fx/bare_tinynet.pth" dcp/ --format dcp --dcp-files 2
expect 0 ckptfix diff dcp/ "$fx/bare_tinynet.pth"

# what runs through torch says so in one line, exit 2
needs_torch ckptfix fit "$fx/bare_tinynet.pth" fitted.pth --model models:TinyNet --model-path "$fx"
python - <<'PY'
import ckptfix

try:
    ckptfix.load("weights.safetensors")
except ckptfix.NeedsTorchError as exc:
    from ckptfix.errors import NEEDS_TORCH

    assert exc.exit_code == 2 and str(exc) == NEEDS_TORCH and NEEDS_TORCH.startswith("needs torch: pip install "), exc
else:
    raise SystemExit("smoke: ckptfix.load worked without torch")
PY
echo "smoke: every torch-free command worked without torch"
