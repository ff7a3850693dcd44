"""Finding the samples of a dataset folder and validating every file before anything is
encoded. All problems are collected and reported together, each naming the file and the fix.

Two folder structures (docs/dataset.md):

one folder                          parallel folders
  cat.png         target              images/cat.png      target
  cat.txt         caption             images/cat.txt      caption
  cat_control.png reference 1         control/cat.png     reference 1
  cat_control_1.png reference 2       control_1/cat.png   reference 2

No references at all is plain FLUX.1-dev training. Images: png, jpg / jpeg, webp.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .atomic import special_kind
from .image_files import IMAGE_EXTENSIONS, FileProblem, gone, read_image, too_large_message, upright_size
from .sizing import MAX_SIDE

CONTROL_NAME = re.compile(r"^(?P<stem>.+)_control(?:_(?P<slot>\d+))?$")
CONTROL_FOLDER = re.compile(r"^control(?:_(?P<slot>\d+))?$")
TARGET_FOLDER = "images"


class DatasetProblems(ValueError):
    """Everything wrong with a dataset folder, one line per problem."""

    def __init__(self, root: Path, problems: list[str]):
        self.root, self.problems = root, problems
        listed = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"The dataset in {root} has {len(problems)} problem(s); nothing was encoded:\n{listed}"
        )


@dataclass
class SampleFiles:
    name: str  # the shared file stem
    target: Path
    references: list[Path]  # in reference order (control, control_1, ...)
    caption: Path | None  # None: no caption file (trained with the empty caption)


@dataclass
class DatasetScan:
    root: Path
    folder_structure: str  # "one_folder" or "parallel_folders"
    samples: list[SampleFiles]
    notices: list[str] = field(default_factory=list)  # conversions and warnings, not errors


def _slot(match) -> int:
    """`_control` / `control` is slot 0; `_control_N` / `control_N` is slot N."""
    return int(match.group("slot")) if match.group("slot") is not None else 0


def _images_by_stem(folder: Path, problems: list[str]) -> dict[str, Path]:
    found: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() not in IMAGE_EXTENSIONS:
            continue
        if path.is_file():
            found[path.stem].append(path)
        elif (kind := special_kind(path)) is not None:
            problems.append(f"{path}: is {kind}, not an image file; replace it with the image")
    for stem, paths in found.items():
        if len(paths) > 1:
            names = ", ".join(p.name for p in paths)
            problems.append(f"{folder}: {names} are two images for '{stem}'; keep one of them")
    return {stem: paths[0] for stem, paths in found.items()}


def caption_file(path: Path, problems: list[str]) -> Path | None:
    """The caption file, None where there is none; a named pipe or a device file in its place is
    a problem saying what it is (it would block a read, or never end)."""
    if path.is_file():
        return path
    kind = special_kind(path)
    if kind is not None:
        problems.append(f"{path}: is {kind}, not a caption file; replace it with a text file")
    return None


def _check_references(
    targets: dict[str, Path], references: dict[str, dict[int, Path]], problems: list[str]
) -> dict[str, list[Path]]:
    """Every sample needs the same references: `_control`, `_control_1`, ... without gaps. The
    number expected is the most common one among samples that have references (ties: the
    larger; a `_control` file is deliberate, a forgotten one is the usual mistake); each file
    a sample lacks, or has beyond it, is named. Returns each target's references in order."""
    slots_of = {stem: references.get(stem, {}) for stem in targets}
    counts = Counter(len(slots) for slots in slots_of.values() if slots)
    expected = max(counts, key=lambda count: (counts[count], count)) if counts else 0
    if expected > MAX_REFERENCES:  # each reference adds its tokens to every step
        stem = next(stem for stem, slots in slots_of.items() if len(slots) == expected)
        problems.append(
            f"{targets[stem]}: its samples have {expected} references each; at most {MAX_REFERENCES} "
            "are supported (each one adds its image tokens to every step); use fewer references"
        )
        return {stem: [] for stem in slots_of}
    for stem, slots in slots_of.items():
        target = targets[stem]
        for slot in range(expected):
            if slot not in slots:
                problems.append(
                    f"{target.parent / f'{stem}_{_slot_name(slot)}.png'} (or .jpg / .webp) is missing: "
                    f"{_evidence(targets, slots_of, slot)}, and every sample needs the same references; "
                    f"add it, or remove {target.name}"
                )
        for slot in sorted(s for s in slots if s >= expected):
            problems.append(
                f"{slots[slot]}: {target.name} has more references than most samples ({expected}); "
                "remove this one, or give every sample the same references"
            )
    return {stem: [slots[s] for s in sorted(slots)] for stem, slots in slots_of.items()}


def _evidence(targets: dict[str, Path], slots_of: dict[str, dict[int, Path]], slot: int) -> str:
    """Why a reference is expected: a sample that has it, or the numbering rule."""
    for stem, slots in slots_of.items():
        if slot in slots:
            return f"{targets[stem].name} has {slots[slot].name}"
    return "references are numbered _control, _control_1, _control_2, ... without gaps"


def _slot_name(slot: int) -> str:
    return "control" if slot == 0 else f"control_{slot}"


def _scan_one_folder(root: Path, problems: list[str]) -> list[SampleFiles]:
    targets, references = {}, defaultdict(dict)
    for stem, path in _images_by_stem(root, problems).items():
        match = CONTROL_NAME.match(stem)
        if match:
            references[match.group("stem")][_slot(match)] = path
        else:
            targets[stem] = path
    for stem, slots in references.items():
        if stem not in targets:
            for path in slots.values():
                problems.append(
                    f"{path}: a reference without a target image '{stem}.png/.jpg/.webp'; "
                    "add the target or remove the reference"
                )
    refs = _check_references(targets, references, problems)
    samples = []
    for stem, target in targets.items():
        caption = caption_file(root / f"{stem}.txt", problems)
        samples.append(SampleFiles(stem, target, refs[stem], caption))
    return samples


def _scan_parallel(root: Path, problems: list[str]) -> list[SampleFiles]:
    target_dir = root / TARGET_FOLDER
    targets = _images_by_stem(target_dir, problems)
    control_dirs = {}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        match = CONTROL_FOLDER.match(folder.name)
        if match:
            control_dirs[_slot(match)] = folder
    if control_dirs and sorted(control_dirs) != list(range(len(control_dirs))):
        have = ", ".join(f"{_slot_name(s)}/" for s in sorted(control_dirs))
        problems.append(
            f"{root}: reference folders {have} skip a number; rename them control/, control_1/, ..."
        )
    if len(control_dirs) > MAX_REFERENCES:  # each reference adds its tokens to every step
        problems.append(
            f"{root}: {len(control_dirs)} reference folders; at most {MAX_REFERENCES} are supported "
            "(each one adds its image tokens to every step); use fewer references"
        )
        control_dirs = {}
    per_folder = {slot: _images_by_stem(folder, problems) for slot, folder in control_dirs.items()}
    for images in per_folder.values():
        for stem, path in images.items():
            if stem not in targets:
                problems.append(
                    f"{path}: a reference without a target {TARGET_FOLDER}/{stem}.png/.jpg/.webp; "
                    "add the target or remove the reference"
                )
    samples = []
    for stem, target in targets.items():
        refs = []
        for slot in sorted(per_folder):
            if stem in per_folder[slot]:
                refs.append(per_folder[slot][stem])
            else:
                problems.append(
                    f"{target}: no reference {control_dirs[slot].name}/{stem}.png/.jpg/.webp; "
                    "add it or remove the target"
                )
        caption = caption_file(target_dir / f"{stem}.txt", problems)
        samples.append(SampleFiles(stem, target, refs, caption))
    return samples


# What one sample may cost before anything encodes it (a 2 MB caption was 363,640 tokens, and
# the text encoder's memory grew until the kernel killed the server): a caption's length (Flux's
# T5 was trained on 512 tokens, about 2,000 characters; ComfyUI's tokenizer does not cut a
# longer one), and the references per sample (FLUX.2 takes up to 10 reference images).
MAX_CAPTION_CHARS = 8192
MAX_REFERENCES = 10


def read_caption(path: Path | None) -> str:
    if path is None:
        return ""
    try:
        size = path.stat().st_size
        if size > 4 * MAX_CAPTION_CHARS:  # over the limit in any UTF-8 text: not read whole
            raise FileProblem(_long_caption(path, f"{size:,} bytes"))
        with path.open("rb") as handle:  # a size the file system does not know: read no more
            raw = handle.read(4 * MAX_CAPTION_CHARS + 4)
        if len(raw) > 4 * MAX_CAPTION_CHARS:
            raise FileProblem(_long_caption(path, f"over {4 * MAX_CAPTION_CHARS:,} bytes"))
        text = raw.decode("utf-8-sig").strip()
        if len(text) > MAX_CAPTION_CHARS:
            raise FileProblem(_long_caption(path, f"{len(text):,} characters"))
        return text
    except UnicodeDecodeError:
        raise FileProblem(f"{path}: the caption is not UTF-8 text; save it as UTF-8") from None
    except FileNotFoundError:
        raise gone(path) from None
    except OSError as error:
        raise FileProblem(
            f"{path}: the caption cannot be read ({error.strerror or error}); check that ComfyUI may "
            "read it, or remove it"
        ) from None


def _long_caption(path: Path, length: str) -> str:
    return (
        f"{path}: the caption is {length} long, over the {MAX_CAPTION_CHARS:,}-character limit (Flux's "
        "text encoder was trained on 512 tokens, about 2,000 characters, and a longer caption costs "
        "memory without helping); shorten it"
    )


def _check_image(path: Path, min_size: int, decode: bool, problems: list[str], notices: list[str]) -> None:
    """Size from the header first: an image over the cap is reported without decoding it (a
    20000x20000 PNG would take gigabytes); the others are decoded when `decode` is set."""
    try:
        width, height = upright_size(path)
        if max(width, height) > MAX_SIDE:
            problems.append(too_large_message(path, width, height))
            return
        if decode:
            notices.extend(read_image(path).notices)
        if min(width, height) < min_size:
            problems.append(
                f"{path}: {width}x{height} is below the minimum side of {min_size} px; "
                "use a larger image or lower min_size"
            )
    except FileProblem as problem:
        problems.append(str(problem))


def within(directory: Path, target: Path) -> bool:
    """True if `target` resolves inside `directory` (both with their links resolved): the rule
    of ComfyUI 0.33's `folder_paths.is_within_directory`, the same on 0.3.75, which lacks it."""
    try:
        directory, target = os.path.realpath(directory), os.path.realpath(target)
        return os.path.commonpath((directory, target)) == directory
    except ValueError:  # a NUL byte, or another drive on Windows: not safely inside
        return False


def scan_dataset(
    root: Path, min_size: int = 0, decode: bool = True, confined_to: Path | None = None
) -> DatasetScan:
    """Find the samples under `root` and validate every file; raise DatasetProblems listing
    all problems at once. With `decode`, each image is fully decoded (catches truncated
    files); otherwise only headers are read. `confined_to` (a dataset picked in ComfyUI's
    input directory): a file that is a link leading out of it is a problem, and is not read."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetProblems(root, [f"{root} is not a folder; choose a folder of images"])
    problems: list[str] = []
    parallel = (root / TARGET_FOLDER).is_dir()
    try:
        samples = _scan_parallel(root, problems) if parallel else _scan_one_folder(root, problems)
    except OSError as error:  # a folder that cannot be listed
        raise DatasetProblems(
            root,
            [f"{error.filename or root}: cannot be read ({error.strerror}); check that ComfyUI may read it"],
        ) from None
    if not samples and not problems:
        where = root / TARGET_FOLDER if parallel else root
        problems.append(f"{where}: no target images (.png, .jpg, .webp) found")
    notices: list[str] = []
    if confined_to is not None:
        outside = _outside(samples, confined_to)
        problems.extend(outside.values())
        samples = [s for s in samples if not any(f in outside for f in _files(s))]
    for sample in samples:
        for path in [sample.target, *sample.references]:
            _check_image(path, min_size, decode, problems, notices)
        if sample.caption is None:
            notices.append(
                f"{sample.target.name}: no caption file ({sample.name}.txt); trained with an empty caption"
            )
        else:
            try:
                if not read_caption(sample.caption):
                    notices.append(
                        f"{sample.caption.name}: the caption is empty; trained with an empty caption"
                    )
            except FileProblem as problem:
                problems.append(str(problem))
    if problems:
        raise DatasetProblems(root, problems)
    return DatasetScan(root, "parallel_folders" if parallel else "one_folder", samples, notices)


def _files(sample: SampleFiles) -> list[Path]:
    return [sample.target, *sample.references, *([sample.caption] if sample.caption else [])]


def _outside(samples: list[SampleFiles], directory: Path) -> dict[Path, str]:
    """The samples' files that are links leading out of `directory`, each with its problem."""
    return {
        file: (
            f"{file}: a link to {os.path.realpath(file)}, outside ComfyUI's input directory; links "
            "out of it are not followed: copy the file into the dataset, or give the dataset's "
            "location in path"
        )
        for sample in samples
        for file in _files(sample)
        if not within(directory, file)
    }


def folder_fingerprint(root: Path) -> str:
    """Names, sizes and modification times of the files under `root` and its direct subfolders
    (the two levels a dataset uses): changes when the dataset changes, so ComfyUI re-runs the
    node that loads it."""
    digest = hashlib.sha256(str(root).encode())
    if root.is_dir():
        for directory, subdirs, files in os.walk(root):
            depth = Path(directory).relative_to(root).parts
            if len(depth) >= 1:
                subdirs[:] = []
            for name in sorted(files):
                try:
                    stat = (Path(directory) / name).stat()
                except OSError:  # a broken link, a file removed meanwhile: the scan will say so
                    digest.update(f"{directory}/{name}|unreadable".encode())
                    continue
                digest.update(f"{directory}/{name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()
