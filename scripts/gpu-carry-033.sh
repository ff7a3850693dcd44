#!/usr/bin/env bash
# Add ComfyUI 0.33 (what users run) to the GPU carry, from the project's root, after
#   bash ../shared/gpu/prepare-carry.sh
# That script carries ComfyUI 0.3.75 (.comfyui) only, and the carry limit (64 MiB) rules out the
# unpacked 0.33 folder: this adds its 7 MB source tarball and the small wheels 0.33 needs beyond
# 0.3.75 (comfy-aimdo: dynamic VRAM; torchaudio: imported at start), and .gpu-carry/run-033.sh,
# which unpacks 0.33 on the GPU machine and runs the GPU layer there without --cpu (dynamic VRAM
# on, 0.33's default on NVIDIA) and with --disable-dynamic-vram (tests/gpu/test_dynamic_vram_gpu.py).
# 0.33 imports comfy-kitchen (its quantized kernels) at start: its wheel (58 MB, 227 MB installed)
# is over the carry limit, so this carries its CUDA backend alone, the 176 MB library xz-compressed
# (about 21 MB, a minute to compress, kept in ~/.cache between calls), without the HIP backend.
# ComfyUI 0.3.75 (.comfyui) travels as a 5 MB tarball inside .gpu-carry, so both fit in 64 MiB.
# Then, with carry [".gpu-carry"] (the tree, .gpu-carry: about 60 MB):
#   bash .gpu-carry/run-033.sh                  # the GPU layer on ComfyUI 0.33
#   bash .gpu-carry/run-0375.sh                 # the GPU layer on ComfyUI 0.3.75
# With KT_GPU_CARRY_PYAV=1 it carries real PyAV (35 MB) instead of comfy-kitchen's CUDA library:
# 0.33's LoadImage decodes every PNG with PyAV, so the GPU server tests need it, and both do not
# fit. comfy-kitchen then runs its eager and triton backends (its import tolerates the missing
# library), and the wheels no GPU test imports (diffusers, kornia) stay behind. Run
# prepare-carry.sh again to go back to the default carry.
set -euo pipefail
ROOT="$(pwd)"
CARRY="$ROOT/.gpu-carry"
TARBALL="${KT_COMFYUI_033_TARBALL:-$ROOT/../shared/comfyui/comfyui-0.33.0.tar.gz}"
[[ -x "$CARRY/run.sh" ]] || { echo "run bash ../shared/gpu/prepare-carry.sh first (no .gpu-carry/run.sh)"; exit 2; }
[[ -f "$TARBALL" ]] || { echo "no ComfyUI 0.33 source at $TARBALL (set KT_COMFYUI_033_TARBALL)"; exit 2; }
cp "$TARBALL" "$CARRY/comfyui-0.33.tar.gz"
rm -f "$CARRY"/wheels/torchaudio-*.whl   # the GPU image has torchaudio 2.11
tar cJf "$CARRY/comfyui-0.3.75.tar.xz" .comfyui
KITCHEN="$(sed -n 's/^comfy-kitchen==//p' "$ROOT/.comfyui-0.33/requirements.txt" 2>/dev/null || true)"
KITCHEN="${KITCHEN:-0.2.31}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kontext-trainer-gpu-carry/comfy_kitchen-$KITCHEN.tar"
if [[ ! -f "$CACHE" ]]; then
  TMP="$(mktemp -d)"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    -d "$TMP" "comfy-kitchen==$KITCHEN" 2>&1 | grep -v "is ignored" || true
  (cd "$TMP" && unzip -q ./*.whl && rm -f ./*.whl comfy_kitchen/backends/hip/_C*.so \
     && xz -9 -T2 comfy_kitchen/backends/cuda/_C*.so && tar cf t.tar comfy_kitchen comfy_kitchen-*.dist-info)
  mkdir -p "$(dirname "$CACHE")" && mv "$TMP/t.tar" "$CACHE" && rm -rf "$TMP"
fi
cp "$CACHE" "$CARRY/comfy_kitchen.tar"
if [[ "${KT_GPU_CARRY_PYAV:-0}" == 1 ]]; then
  TMP="$(mktemp -d)"
  (cd "$TMP" && tar xf "$CARRY/comfy_kitchen.tar" && rm -f comfy_kitchen/backends/cuda/_C*.so.xz \
     && tar cf "$CARRY/comfy_kitchen.tar" comfy_kitchen comfy_kitchen-*.dist-info)
  rm -rf "$TMP" "$CARRY"/wheels/diffusers-*.whl "$CARRY"/wheels/kornia*.whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$CARRY/wheels" "av>=16" 2>&1 \
    | grep -v "is ignored" || true
fi
for p in comfy-aimdo==0.4.13; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$CARRY/wheels" "$p" >/dev/null 2>&1 || echo "[gpu-carry-033] could not fetch $p: the GPU image must have it"
done
# 0.33 imports more of PyAV than the stand-in of prepare-carry.sh has (av.video.reformatter,
# av.codec, ...): this one answers every av.* submodule with the same import-only stand-in
cat > "$CARRY/stubs/av/__init__.py" <<'PY'
# Import-only stand-in for PyAV: ComfyUI's video nodes import it; no GPU test uses them.
import importlib.abc, importlib.machinery, sys, types
class _Meta(type):
    def __getattr__(cls, name):
        return cls
class _Any(metaclass=_Meta):
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return self
    def __getattr__(self, name): return self
def __getattr__(name):
    return _Any
class _Stand(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("av."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, _Stand())
PY
rm -rf "$CARRY/stubs/av/container" "$CARRY/stubs/av/subtitles"
if ls "$CARRY"/wheels/av-*.whl >/dev/null 2>&1; then rm -rf "$CARRY/stubs/av"; fi
cat > "$CARRY/run-033.sh" <<'SH'
#!/usr/bin/env bash
# On the GPU machine, from the project's root: ComfyUI 0.33 unpacked into .comfyui-0.33, then
# run.sh with it as the ComfyUI under test (default: the GPU layer).
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p .comfyui-0.33 && tar xzf "$HERE/comfyui-0.33.tar.gz" -C .comfyui-0.33 --strip-components=1
rm -f .comfyui-0.33/extra_model_paths.yaml
[[ -d .comfyui ]] || tar xJf "$HERE/comfyui-0.3.75.tar.xz"   # the test helpers read both
mkdir -p /tmp/kitchen && tar xf "$HERE/comfy_kitchen.tar" -C /tmp/kitchen && { ! ls /tmp/kitchen/comfy_kitchen/backends/cuda/_C*.so.xz >/dev/null 2>&1 || xz -d -f /tmp/kitchen/comfy_kitchen/backends/cuda/_C*.so.xz; }
export PYTHONPATH="/tmp/kitchen${PYTHONPATH:+:$PYTHONPATH}"
export KONTEXT_TRAINER_COMFYUI="$PWD/.comfyui-0.33"
exec bash "$HERE/run.sh" "$@"
SH
cat > "$CARRY/run-0375.sh" <<'SH'
#!/usr/bin/env bash
# On the GPU machine, from the project's root: ComfyUI 0.3.75 unpacked into .comfyui, then run.sh.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -d .comfyui ]] || tar xJf "$HERE/comfyui-0.3.75.tar.xz"
exec bash "$HERE/run.sh" "$@"
SH
chmod +x "$CARRY/run-033.sh" "$CARRY/run-0375.sh"
du -sh "$CARRY" | sed 's/^/[gpu-carry-033] /'
echo "[gpu-carry-033] ready: carry [\".gpu-carry\"]; commands: bash .gpu-carry/run-033.sh, bash .gpu-carry/run-0375.sh"
