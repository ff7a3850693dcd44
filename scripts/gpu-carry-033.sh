#!/usr/bin/env bash
# Add ComfyUI 0.33 (what users run) to the GPU carry, from the project's root, after
#   bash ../shared/gpu/prepare-carry.sh
# That script carries ComfyUI 0.3.75 (.comfyui) only, and the carry limit (64 MiB) rules out the
# unpacked 0.33 folder: this adds its 7 MB source tarball and the small wheels 0.33 needs beyond
# 0.3.75 (comfy-aimdo: dynamic VRAM; torchaudio: imported at start), and .gpu-carry/run-033.sh,
# which unpacks 0.33 on the GPU machine and runs the GPU layer there without --cpu (dynamic VRAM
# on, 0.33's default on NVIDIA) and with --disable-dynamic-vram (tests/gpu/test_dynamic_vram_gpu.py).
# comfy-kitchen (227 MB installed) cannot travel: 0.33 starts without it (no quantized kernels),
# unless the GPU image has it. Then, with carry [".comfyui", ".gpu-carry"]:
#   bash .gpu-carry/run-033.sh                  # the GPU layer on ComfyUI 0.33
set -euo pipefail
ROOT="$(pwd)"
CARRY="$ROOT/.gpu-carry"
TARBALL="${KT_COMFYUI_033_TARBALL:-$ROOT/../shared/comfyui/comfyui-0.33.0.tar.gz}"
[[ -x "$CARRY/run.sh" ]] || { echo "run bash ../shared/gpu/prepare-carry.sh first (no .gpu-carry/run.sh)"; exit 2; }
[[ -f "$TARBALL" ]] || { echo "no ComfyUI 0.33 source at $TARBALL (set KT_COMFYUI_033_TARBALL)"; exit 2; }
cp "$TARBALL" "$CARRY/comfyui-0.33.tar.gz"
for p in comfy-aimdo==0.4.13 torchaudio==2.11.0; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$CARRY/wheels" "$p" >/dev/null 2>&1 || echo "[gpu-carry-033] could not fetch $p: the GPU image must have it"
done
cat > "$CARRY/run-033.sh" <<'SH'
#!/usr/bin/env bash
# On the GPU machine, from the project's root: ComfyUI 0.33 unpacked into .comfyui-0.33, then
# run.sh with it as the ComfyUI under test (default: the GPU layer).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p .comfyui-0.33 && tar xzf "$HERE/comfyui-0.33.tar.gz" -C .comfyui-0.33 --strip-components=1
rm -f .comfyui-0.33/extra_model_paths.yaml
export KONTEXT_TRAINER_COMFYUI="$PWD/.comfyui-0.33"
exec bash "$HERE/run.sh" "$@"
SH
chmod +x "$CARRY/run-033.sh"
du -sh "$CARRY" | sed 's/^/[gpu-carry-033] /'
echo "[gpu-carry-033] ready: carry [\".comfyui\", \".gpu-carry\"]; command: bash .gpu-carry/run-033.sh"
