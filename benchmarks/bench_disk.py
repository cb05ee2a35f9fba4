"""What the disk allows a durable dump: a write of N MiB that is on the disk when it returns.

Run: .venv/bin/python benchmarks/bench_disk.py [--mib 10] [--tries 12] [--dir DIR]
Prints the filesystem of DIR (default: the current directory; a tmpfs there measures memory, not
a disk) and, in ms (best, median and worst of the tries), three ways of putting one buffer in a
new file:
- ``O_DIRECT`` and an ``fsync``: with one writer, how stepskip writes a big entry's tensor file
  (before any encoding, and without the directory syncs and the rename that publish an entry:
  a lower bound); split over 2 and 4 writers (each its share, by ``pwrite``) to see whether more
  writers would help;
- through the page cache and an ``fsync``;
- through the page cache without a sync: what verl's ``torch.save`` does, durable only later.
The kinds are alternated try by try, so the VM's drift reaches each alike.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ALIGN = 4096  # O_DIRECT's alignment of memory, offset and length


def write_file(path: str, view: memoryview, writers: int, direct: bool, sync: bool) -> float:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    try:
        start = time.perf_counter()
        share = len(view) // writers // ALIGN * ALIGN
        bounds = [(i * share, len(view) if i == writers - 1 else (i + 1) * share) for i in range(writers)]
        with ThreadPoolExecutor(max_workers=writers) as pool:
            for done in [pool.submit(_pwrite_all, fd, view[lo:hi], lo) for lo, hi in bounds]:
                done.result()  # a writer's error fails the run instead of timing a write that did not happen
        if sync:
            os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)


def filesystem(directory: str) -> str:
    """The type of the filesystem ``directory`` is on (``/proc/self/mountinfo``: the deepest mount holding it)."""
    path, best, kind = os.path.realpath(directory), "", "unknown"
    try:
        with open("/proc/self/mountinfo") as fh:
            for line in fh:
                fields = line.split()
                mount, fstype = fields[4], fields[fields.index("-") + 1]
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fstype
    except (OSError, ValueError, IndexError):  # not Linux, or an unexpected line: the type is only shown
        pass
    return kind


def takes_direct(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with ``O_DIRECT``."""
    path = f"{directory}/probe"
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    except OSError:
        return False
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return True


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=10, help="size of the file, MiB (default 10: a V1 step)")
    parser.add_argument("--tries", type=int, default=12, help="tries of each kind (default 12)")
    parser.add_argument("--dir", default=".", help="where to write (default: the current directory)")
    args = parser.parse_args()
    if args.mib < 1 or args.tries < 1:
        parser.error("--mib and --tries must be at least 1")
    if not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir}: not a directory; give an existing directory on the disk to measure")
    # page-aligned and touched once, as a dump's recycled pages are
    buffer = mmap.mmap(-1, args.mib << 20)
    buffer.write(os.urandom(args.mib << 20))
    view = memoryview(buffer)
    kinds = {"O_DIRECT + fsync, 1 writer": (1, True, True), "O_DIRECT + fsync, 2 writers": (2, True, True),
             "O_DIRECT + fsync, 4 writers": (4, True, True), "page cache + fsync": (1, False, True),
             "page cache, no sync (verl)": (1, False, False)}
    with tempfile.TemporaryDirectory(prefix="stepskip-bench-disk-", dir=args.dir) as workdir:
        if not takes_direct(workdir):
            print(f"bench_disk: {workdir}'s filesystem refuses O_DIRECT (some FUSE mounts, older tmpfs): "
                  "timing the page cache only")
            kinds = {name: kind for name, kind in kinds.items() if not kind[1]}
        times: dict[str, list[float]] = {name: [] for name in kinds}
        for attempt in range(args.tries):
            for name, (writers, direct, sync) in kinds.items():
                times[name].append(write_file(f"{workdir}/{attempt}-{writers}-{direct}-{sync}", view, writers,
                                              direct, sync))
    kind = filesystem(args.dir)
    print(f"bench_disk: {args.mib} MiB per file in {os.path.realpath(args.dir)} ({kind}), "
          f"{args.tries} tries of each kind, alternated; ms best (median) worst")
    if kind in ("tmpfs", "ramfs"):
        print(f"  note: {kind} keeps files in memory: these are memory speeds, not a disk's")
    for name, seconds in times.items():
        print(f"  {name:32s} {min(seconds) * 1e3:7.1f} ({statistics.median(seconds) * 1e3:7.1f}) "
              f"{max(seconds) * 1e3:7.1f}")


if __name__ == "__main__":
    main()
