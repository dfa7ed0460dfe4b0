"""Opening a data directory: its marker, its index's identity and erasure code.

``DataDir`` is the data-directory part of ``kvstore.embedded.store.EmbeddedStore``. Its
``open`` runs once, from the store's ``__init__``, and leaves on the part the ``config`` with
the directory's code resolved, the erasure ``code``, the ``targets`` (and ``target_specs``)
opened, how writes are made durable (``sync_mode``), the ``index`` open and its identity
(``index_id``); the store builds its other parts from those. ``kvstore.maintenance.reindex``
uses ``read_marker`` and ``resolve_code`` to rebuild an index without opening one;
``kvstore.maintenance.migrate`` uses ``read_marker`` and ``write_marker_file`` to take a directory
of an older format version to this one (``kvtool migrate``).

The marker ``<data_dir>/kvstore.json`` records what every record of the directory
depends on: the format version, the erasure code (``ec_type``, ``ec_k``, ``ec_m``:
records are decoded and the default targets laid out with it), the identity of its
index (``index_id``), and the configured targets (``targets``; none for the default
layout; opened when a config names none). The index keeps the identity and the code
too (``kvstore.embedded.index``, ``Index.settle``): processes creating one directory at once agree there, and a lost
marker is rewritten from it. An index that is missing, emptied or another directory's
is refused (``CorruptData``) rather than taken for an empty store whose fragments GC
would sweep as orphans. A marker of another format version (``DATA_FORMAT_VERSION``) is
refused (``IncompatibleFormat``) with what to do (``format_refusal``), never read as this one.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvstore.embedded import codec
from kvstore.config import (DEFAULT_EC_K, DEFAULT_EC_M, DEFAULT_EC_TYPE, LEGACY_EC_TYPE, StoreConfig, TargetSpec,
                            split_userinfo, target_name)
from kvstore.errors import CorruptData, IncompatibleFormat, InvalidRequest
from kvstore.embedded.index import Index, index_remedy
from kvstore.embedded.durability import fsync_dir
from kvstore.embedded.fragment_writes import resolve_sync_mode
from kvstore.embedded.targets import TARGET_TYPES, LocalTarget, Target, localhost_file_url, open_target

# The data directory's format version, recorded in its marker (``FORMAT_FILE``):
# 2: entries carry their created and expiry times (``kvstore.embedded.codec``), so ``kvtool rebuild-index``
#    can give them back.
# 3: pack files may grow by appends after they were first published ("segments": a writer keeps
#    appending fragment frames to its open pack until it is full); a record never names bytes
#    beyond what was durable when it was indexed. Frames and records are version 2's, so a
#    version 2 directory's files are valid version 3 files; but code of version 2 assumes a
#    published pack never grows (its rebuild-index and GC read and count packs whole), so it
#    must never run on a version 3 directory, which it refuses (it reads only version 2).
# A version 2 directory is refused until ``kvtool migrate`` (``kvstore.maintenance.migrate``)
# rewrites its marker, once every process of the old version has stopped; a version 1 directory
# is refused for good, never read as a later version.
DATA_FORMAT_VERSION = 3
FORMAT_FILE = "kvstore.json"
# Format versions ``kvtool migrate`` takes to ``DATA_FORMAT_VERSION`` by rewriting the marker alone
# (their files are valid files of this version).
MIGRATES_FROM = frozenset({2})

log = logging.getLogger("kvstore.embedded.store")


def _holds_files(root: Path, skip: frozenset[str] = frozenset()) -> bool:
    """Is there any file below ``root`` (a directory that may not exist), not counting those
    under a directory whose real path is in ``skip``?"""
    for d, subdirs, files in os.walk(root):
        if os.path.realpath(d) in skip:
            subdirs[:] = []
            continue
        if files:
            return True
    return False


def _same_dir(a: str, b: str) -> bool:
    """Are ``a`` and ``b`` one directory (one device and inode: a bind mount, an export mounted
    twice), though their real paths differ?"""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _nonempty(path: Path) -> bool:
    """Does ``path`` exist with at least one byte (an LMDB index that was ever opened does)?"""
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _targets_record(config: StoreConfig) -> list[dict] | None:
    """The configured targets as the marker records them; ``None`` (nothing recorded) for the
    embedded default layout under the data directory, so the directory can move, and for
    targets whose URL carries ``user:password@``: credentials are never written to disk
    (such a directory is opened with its targets named, as before)."""
    if not config.targets or any(split_userinfo(t.url)[1] is not None for t in config.targets):
        return None
    return [{"url": _absolute(t.url), "domain": t.domain, "name": t.name} for t in config.targets]


def _local_root(url: str) -> str | None:
    """The directory a local target URL opens, parsed exactly as ``kvstore.embedded.targets.open_target``
    parses it (``LocalTarget.root``: absolute, ``~`` expanded, ``file:/x`` and ``local:x`` read
    as ``/x`` and ``x``); ``None`` for a URL that opens no local directory. Parsed by the
    target's own code, never cut out of the URL by hand, so that the marker records the
    directory a target opens (``file:/x`` is ``/x``, ``~/x`` the home directory's ``x``)."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if TARGET_TYPES.get(scheme) is not LocalTarget:
        return None
    try:
        return LocalTarget(TargetSpec(url)).root
    except InvalidRequest:  # not a URL fsspec can open: compared and recorded as written
        return None


def _absolute(url: str) -> str:
    """A local target's URL as the marker records it: the directory it opened (``_local_root``;
    a relative path means the opener's working directory, which the next opener does not
    share), its ``file://`` or ``local://`` scheme kept; other URLs as written."""
    root = _local_root(url)
    if root is None:
        return url
    scheme = url.split("://", 1)[0] if "://" in url else ""
    return f"{scheme}://{root}" if scheme else root


def _place(url: str) -> str:
    """What two target URLs are compared by to tell "the same target": the real path of the
    directory a local target opens (``_local_root``, symlinks and ``..`` resolved, as
    ``LocalTarget.location``) however it is spelled; other URLs as written. ``_absolute`` keeps
    the spelling the marker records; this is only for comparing (a symlinked spelling of a
    recorded directory, or ``file:/x`` for ``/x``, must not hide a rename)."""
    root = _local_root(url)
    return url if root is None else os.path.realpath(root)


def _same_targets(a: Any, b: Any) -> bool:
    """Do two target records (``_targets_record``'s form, or what a marker holds; ``None`` for
    none) name the same targets, in the same order? URLs are compared by ``_place``, so one
    local directory spelled ``/x`` once and ``file:///x`` the other time is the same target
    (no "configured targets differ" warning, no rewritten marker); names
    by ``target_name``, so a name recorded as ``file://localhost/P`` is ``file:///P``."""
    def key(rec: Any) -> Any:
        if not isinstance(rec, list) or not all(isinstance(t, dict) and isinstance(t.get("url"), str) for t in rec):
            return rec  # none, or a hand-edited record: compared as written
        return [(_place(t["url"]), t.get("domain"), _name(t.get("name"))) for t in rec]
    return key(a) == key(b)


def _name(name: Any) -> Any:
    """A recorded target name as ``TargetSpec`` spells it (``target_name``); a hand-edited
    non-string as written."""
    return target_name(name) if isinstance(name, str) else name


def _respelled(rec: Any) -> bool:
    """Does a marker's target record hold a URL other than as ``_absolute`` records it: a
    relative local path (``file://d0``) means the opener's working directory, so it is
    rewritten, resolved, by an opener that configures the same targets; compared by ``_place``
    alone it would equal them and stay relative, and an opener elsewhere naming no targets
    would open other, empty directories."""
    return isinstance(rec, list) and any(
        isinstance(t, dict) and isinstance(t.get("url"), str) and _absolute(t["url"]) != t["url"] for t in rec)


def _cwd_relative(url: str) -> bool:
    """Is ``url`` a local target given by a relative path (``d0``, ``file://d0``, ``local://d0``)?
    A marker that records one means the working directory of the process that wrote it,
    which no later opener knows."""
    if _local_root(url) is None:
        return False
    bare = localhost_file_url(split_userinfo(url)[0])
    if "://" in bare:
        path = bare.split("://", 1)[1]
    else:
        path = bare.split(":", 1)[1] if bare.startswith(("file:", "local:")) else bare
    return not os.path.isabs(os.path.expanduser(path))


def with_recorded_targets(config: StoreConfig, marker: dict | None) -> StoreConfig:
    """``config`` with the marker's recorded targets when it names none itself: so ``kvtool``
    and a daemon started without ``KVSTORE_TARGETS`` open the targets the directory was
    written to, not the default ones (whose absence would read as every entry lost). Targets
    that are configured win, and are recorded in their turn (``_write_marker``)."""
    recorded = (marker or {}).get("targets")
    if not recorded:
        return config
    if config.targets:
        return config  # differing ones are logged once recorded (``DataDir.open``), not before a refusal
    try:
        specs = tuple(TargetSpec(**t) for t in recorded)
        config = replace(config, targets=specs)
    except InvalidRequest as exc:
        raise IncompatibleFormat(f"the targets recorded in {FORMAT_FILE} are unusable ({exc}); correct its "
                                 "'targets', or name the targets (KVSTORE_TARGETS, --targets)") from exc
    relative = [t.url for t in specs if _cwd_relative(t.url)]
    if relative:
        # Resolved against this process's working directory they may be other directories (empty,
        # or another store's, whose files the orphan sweep would take): every entry read as lost.
        raise InvalidRequest(
            f"{FORMAT_FILE} records targets by relative paths ({', '.join(relative)}), as code before "
            "absolute URLs were recorded wrote them: relative to the working directory of the process that "
            f"wrote it, which is not known here (this one's is {os.getcwd()}). Name the targets once with "
            "absolute paths (KVSTORE_TARGETS, --targets, targets=): the marker is then rewritten with them")
    # Local as the targets are opened (``_local_root``: plain paths, file:// and local:// URLs
    # alike, so that a moved set of local:// targets is refused, not read as every entry lost).
    local = [t for t in specs if _local_root(t.url) is not None]
    if len(local) == len(specs) and not any(os.path.isdir(_place(t.url)) for t in local):
        # Every recorded root gone at once is a directory moved or disks not mounted, not a loss:
        # opening on them would mark every entry lost on its first read.
        raise InvalidRequest(
            f"none of the targets recorded in {FORMAT_FILE} is there ({', '.join(t.url for t in specs)}): "
            "was the data directory moved, or are the disks not mounted? Name the targets "
            "(KVSTORE_TARGETS, --targets) or mount them")
    log.info("targets as recorded in %s: %s", FORMAT_FILE, ", ".join(f"{t.name}={t.url}" for t in specs))
    return config


def _log_recorded(config: StoreConfig, before: Any) -> None:
    """Warn that the marker now records ``config``'s targets in place of ``before`` (what it
    recorded), when they differ. Logged only once the marker is written: an open refused for
    renamed, moved or foreign targets records nothing, so it warns of nothing either."""
    mine = _targets_record(config)
    if before and mine is not None and not _same_targets(mine, before):
        log.warning("the configured targets differ from those %s records; recording them instead: %s",
                    FORMAT_FILE, ", ".join(f"{t.name}={t.shown_url}" for t in config.targets))


def file_url_path(url: str) -> str:
    """The local path of a plain path or ``file:`` URL; another host, a query or a fragment
    is ``InvalidRequest`` (``kvstore.connect`` checks the same before ``open_embedded`` calls this)."""
    if not url.lower().startswith("file:"):
        return url
    if "?" in url or "#" in url:
        raise InvalidRequest(f"{url!r}: a file URL cannot hold a query ('?') or fragment ('#'); "
                             "give the directory as a plain path if its name contains one")
    rest = url[len("file:"):]
    if rest.startswith("//"):
        host, sep, path = rest[2:].partition("/")
        if host not in ("", "localhost"):
            raise InvalidRequest(f"{url!r} names host {host!r}: a data directory is local; write file:///PATH "
                                 "(three slashes) or a plain path")
        rest = sep + path
    if not rest.startswith("/"):
        raise InvalidRequest(f"{url!r}: a file URL holds an absolute path (file:///PATH); use a plain path "
                             "for a relative one")
    return rest


class DataDir:
    """Opening and recording the data directory ``data_dir`` (see the module docstring)."""

    def __init__(self, data_dir: Path):
        self.data_dir = data_dir
        self.config: StoreConfig | None = None
        self.code: Any = None
        self.target_specs: tuple[TargetSpec, ...] = ()
        self.targets: dict[str, Target] = {}
        self.sync_mode: str | None = None
        self.index: Index | None = None
        self.index_id = b""

    def open(self, config: StoreConfig) -> bool:
        """Check or create the directory, open its index; True when it was created now."""
        self.config = config
        marker = self.read_marker()
        named = bool(config.targets)  # by the opener, not taken from the marker
        config = self.config = with_recorded_targets(config, marker)
        index_dir = self.data_dir / "index"
        # New: no marker and no index. A marker lost with its index in place (a crash between
        # creating the index and writing the marker, or a deleted file) is rewritten from the
        # index as an old marker is: fields it lacks come from the records.
        fresh = marker is None and not _nonempty(index_dir / "data.mdb")
        if fresh:  # the code and targets settled (and refused if bad) before anything is created
            self._settle(self.resolve_code(config, None))
            self._refuse_used_targets()
        rewrite = marker is None
        if marker is None:  # the code this version writes unless told otherwise (not the legacy one)
            marker = {"ec_type": config.ec_type or DEFAULT_EC_TYPE}
        # A marker says the directory was written before: its index must be there. (A marker from
        # before index_id was recorded may precede its index by a crash: then no target holds a file.)
        if (not rewrite and not _nonempty(index_dir / "data.mdb")
                and (marker.get("index_id") or _holds_files(self.data_dir / "targets"))):
            raise CorruptData(
                f"the index of data directory {self.data_dir} is missing or empty ({index_dir / 'data.mdb'}); "
                "opening it would make every stored fragment an orphan for GC to delete; "
                f"{index_remedy(str(index_dir))}")
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise InvalidRequest(f"cannot use {self.data_dir} as a data directory: {exc.strerror or exc}") from exc
        self.index = Index(str(index_dir), map_size=config.lmdb_map_size,
                           sync=config.fsync, max_readers=config.max_readers,
                           compact_ratio=config.pack_compact_ratio)
        try:
            # The identity and the code are settled in the index in one transaction: creators racing
            # each other agree there (a loser adopts the winner's code, or is refused if it asked for
            # another), and the code is known even where the marker is lost.
            identity, code = self.index.settle(os.urandom(16), lambda txn: self._proposed_code(config, None if fresh else marker, txn))
            self.index_id = identity  # this store's identity (a recreated directory has another: direct writers see it)
            # Settled here unless settled above with this very code (a config that already names the
            # directory's code, e.g. another store's resolved config, is settled here too).
            if not fresh or code != {n: getattr(self.config, n, None) for n in ("ec_type", "ec_k", "ec_m")}:
                self._settle(self.resolve_code(config, code))
            config = self.config
            if not fresh and marker.get("index_id") and marker["index_id"] != identity.hex():
                raise CorruptData(
                    f"the index at {index_dir} is not the one data directory {self.data_dir} was created with "
                    "(it was recreated or copied from another directory); opening it would make every stored "
                    f"fragment an orphan for GC to delete; {index_remedy(str(index_dir))}")
            if not fresh:
                self._refuse_foreign_targets(rewrite)
                self._refuse_renamed_targets(marker)
                self._refuse_moved_targets(marker)
            if (any(marker.get(n) != v for n, v in code.items()) or marker.get("index_id") != identity.hex()
                    or not _same_targets(marker.get("targets"), _targets_record(config))
                    or (named and _respelled(marker.get("targets")))):  # named: resolved as meant
                self._write_marker(config, identity, marker)
                _log_recorded(config, marker.get("targets"))
            if rewrite:
                for t in self.targets.values():
                    t.create_root()
        except BaseException:
            self.index.close()
            raise
        return fresh

    def _refuse_used_targets(self) -> None:
        """``InvalidRequest`` when a new directory is given a target that already holds files:
        another directory's fragments (two directories on one target each sweep the other's
        fragments as orphans), or what a removed one left. A target that cannot be listed now is
        left to the first write to find."""
        for name, t in self.targets.items():
            try:
                first = next(iter(t.walk()), None)
            except OSError:  # root missing (a new target), or not reachable now
                continue
            if first is not None:
                shown = next((s.shown_url for s in self.target_specs if s.name == name), name)
                raise InvalidRequest(
                    f"target {name} ({shown}) already holds files ({first[0]}, ...), and data directory "
                    f"{self.data_dir} is new: they are another data directory's (its orphan sweep and this "
                    "one's would delete each other's fragments) or left over from one; give this directory "
                    "targets of its own, empty these, or open the data directory they belong to")

    def _refuse_foreign_targets(self, marker_lost: bool) -> None:
        """``InvalidRequest`` when the directory has live entries and none of the target names
        its index ever recorded is configured: every record's fragments sit on recorded
        targets, so a right configuration names at least one of them (a subset of them, or
        new targets beside them, is fine). Opening anyway would make ``verify`` mark every
        entry lost; it happens when the marker that records the targets was lost (the default
        layout is then assumed) or the wrong ones are given. A directory holding only lost
        entries opens with new targets, to be repaired or emptied."""
        recorded = self.index.target_names()
        if not recorded or recorded & set(self.targets) or not self.index.has_live():
            return
        why = (f"its {FORMAT_FILE}, which records them, is missing" if marker_lost
               else "the configured targets are not this directory's")
        raise InvalidRequest(
            f"the entries of {self.data_dir} live on targets {', '.join(sorted(recorded))}, none of which is "
            f"configured ({', '.join(self.targets)}): {why}; give the directory's targets (targets=, "
            "KVSTORE_TARGETS, a config file's [store] targets)")

    def _refuse_renamed_targets(self, marker: dict) -> None:
        """``InvalidRequest`` when a configured target has the URL the marker records for
        another name, that name is no longer configured, the index has recorded fragments
        there and live entries remain: the target was renamed. Records name their targets, so
        every fragment there would read as missing (degraded reads, repair rewriting them
        beside themselves); the old name must be given back (``URL#DOMAIN#NAME``)."""
        configured = {t.name for t in self.config.targets}
        by_place = {_place(t.url): t.name for t in self.config.targets}
        recorded = [(_name(r["name"]), _place(r["url"])) for r in marker.get("targets") or []]
        renamed = {old: by_place[place] for old, place in recorded
                   if old not in configured and by_place.get(place, old) != old}
        renamed = {old: new for old, new in renamed.items() if old in self.index.target_names()}
        if not renamed or not self.index.has_live():
            return
        names = ", ".join(f"{old!r} is now configured as {new!r}" for old, new in sorted(renamed.items()))
        raise InvalidRequest(
            f"targets renamed: {names}; the entries of {self.data_dir} name their targets, so their "
            "fragments there would read as missing. Give each target its recorded name (URL#DOMAIN#NAME)")

    def _refuse_moved_targets(self, marker: dict) -> None:
        """``InvalidRequest`` when a configured local target has a name the marker records for
        another local directory, that directory still holds files, no configured target opens
        it, the index has recorded fragments under the name and holds records: re-pointing the
        name would make every fragment there read as missing (the first reads mark entries
        lost) and the marker would forget where they are (``file://localhost/P`` means ``/P``;
        a marker that recorded ``<cwd>/localhost/P`` under the same name is such a case). Not
        refused: one directory spelled otherwise (``_place``) or reached another way (a bind
        mount: ``_same_dir``), a target moved into a subdirectory of its old place (files under a
        configured target are not counted), a recorded relative URL (it is
        rewritten absolute: ``_respelled``), names swapped among configured directories (the
        sweep keeps what a record's own copy does not prove stray: ``kvstore.maintenance.orphans``)."""
        configured = {t.name: t for t in self.config.targets if _local_root(t.url) is not None}
        opened = {_place(t.url) for t in self.config.targets}
        roots = [root for t in self.config.targets if (root := _local_root(t.url)) is not None]
        # a configured target or the data directory inside the recorded one: its files are not the old ones
        skip = frozenset(os.path.realpath(d) for d in [*roots, str(self.data_dir)])
        moved = []
        for r in marker.get("targets") or []:
            name, was = _name(r["name"]), _local_root(r["url"])
            if name not in configured or was is None or _cwd_relative(r["url"]) or _place(r["url"]) in opened:
                continue
            if any(_same_dir(was, root) for root in roots):
                continue  # the same directory reached another way (a bind mount)
            if _holds_files(Path(was), skip):
                moved.append((name, r["url"], configured[name].shown_url))
        moved = [m for m in moved if m[0] in self.index.target_names()]
        if moved:
            with self.index.env.begin() as txn:
                if self.index.first_record(txn) is None:
                    return
            what = "; ".join(f"{name!r} is recorded at {was} but configured as {now}" for name, was, now in moved)
            raise InvalidRequest(
                f"targets moved: {what}. The recorded directories still hold fragments the entries of "
                f"{self.data_dir} name, which would read as missing there, and {FORMAT_FILE} would forget them. "
                "Move each recorded directory to its configured place (then open again; a copy left at the "
                "recorded place must be removed), or configure the recorded URL for that name (URL#DOMAIN#NAME). A file://localhost/PATH target "
                "means /PATH, not <working directory>/localhost/PATH")

    def read_marker(self, *, any_version: bool = False) -> dict | None:
        """The directory's marker (``FORMAT_FILE``) as a dict, or ``None`` for a new directory.
        A marker of another format version than ``DATA_FORMAT_VERSION`` is ``IncompatibleFormat``
        (``format_refusal`` says what to do), unless ``any_version`` (``kvtool migrate``, which
        reads the version itself).

        The marker records what every record of the directory depends on: the format
        version, the erasure code (``ec_type``, ``ec_k``, ``ec_m``: records are decoded and
        the default targets laid out with it) and the identity of its index (``index_id``,
        ``kvstore.embedded.index``), so that a lost or replaced index is refused rather than taken for
        an empty store whose fragments are all orphans. Older markers lack some fields; the
        store fills them in at open.

        A marker that cannot be read as one is ``IncompatibleFormat``, whatever breaks:
        bad JSON or UTF-8 (``ValueError``), a missing or mistyped field, a number too large
        for an int (``OverflowError``: ``1e400``), nesting too deep to parse (``RecursionError``).
        """
        fmt = self.data_dir / FORMAT_FILE
        try:
            exists = fmt.exists()
            if exists:
                doc = json.loads(fmt.read_text())
                ver = doc["format_version"]
                if type(ver) is not int:  # "1", 1.5 and true are not versions this code wrote
                    raise TypeError(f"format_version is {ver!r}")
                for name, typ in (("ec_type", str), ("ec_k", int), ("ec_m", int), ("index_id", str),
                                  ("targets", list)):
                    if name in doc and type(doc[name]) is not typ:
                        raise TypeError(f"{name} is {doc[name]!r}")
                for t in doc.get("targets", []):
                    if type(t) is not dict or set(t) != {"url", "domain", "name"} or not all(
                            type(v) is str for v in t.values()):
                        raise TypeError(f"a recorded target is {t!r}")
            else:
                foreign = self.data_dir.exists() and any(p.name not in ("index", "targets")
                                                         for p in self.data_dir.iterdir())
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError,
                IsADirectoryError) as exc:
            raise IncompatibleFormat(
                f"{fmt} is unreadable ({exc}); this is not a kvstore data directory or it is damaged") from exc
        except OSError as exc:  # a file where the directory should be, no permission, ...
            raise InvalidRequest(f"cannot use {self.data_dir} as a data directory: {exc.strerror or exc}") from exc
        if not exists:
            if foreign:
                raise InvalidRequest(
                    f"{self.data_dir} exists, is not empty and has no {FORMAT_FILE}: refusing to use it "
                    "as a kvstore data directory; pass an empty or new directory")
            return None
        if ver != DATA_FORMAT_VERSION and not any_version:
            raise IncompatibleFormat(format_refusal(self.data_dir, ver))
        return doc

    def resolve_code(self, config: StoreConfig, marker: dict | None) -> StoreConfig:
        """``config`` with the directory's erasure code filled in: an unset field takes the
        recorded value (the defaults for a new directory, or for a marker written before
        that field was recorded); a set one that differs from the record is refused."""
        chosen = {"ec_type": config.ec_type or DEFAULT_EC_TYPE,
                  "ec_k": DEFAULT_EC_K if config.ec_k is None else config.ec_k,
                  "ec_m": DEFAULT_EC_M if config.ec_m is None else config.ec_m}
        if marker is None:
            return replace(config, **chosen)
        recorded = {**chosen, "ec_type": LEGACY_EC_TYPE, **{n: marker[n] for n in chosen if n in marker}}
        for name, value in recorded.items():
            given = getattr(config, name)
            if given not in (None, "") and given != value:
                raise IncompatibleFormat(
                    f"data directory {self.data_dir} was written with {name} {value!r}, this store is "
                    f"configured with {given!r}; leave {name} unset (the directory's is used) or "
                    "start a fresh directory")
        return replace(config, **recorded)

    def _settle(self, config: StoreConfig) -> None:
        """Take ``config`` (its code resolved) as this store's: check the code (an unknown one
        is refused), open its targets, resolve how writes are made durable."""
        self.code = codec.erasure_code(config.ec_k, config.ec_m, config.ec_type)
        self.config = config
        self.target_specs = config.resolved_targets()
        self.targets: dict[str, Target] = {s.name: open_target(s) for s in self.target_specs}
        seen: dict[tuple, str] = {}
        for spec in self.target_specs:  # distinct names may still be one place (a trailing slash, file://)
            where = self.targets[spec.name].location()
            if where in seen:
                raise InvalidRequest(f"targets {seen[where]!r} and {spec.shown_url!r} are the same place; each "
                                     "target must be its own directory, bucket or prefix")
            seen[where] = spec.shown_url
        if self.sync_mode is None:  # resolved once, and before anything is created for a new directory
            self.sync_mode = resolve_sync_mode(config, self.targets)

    def _proposed_code(self, config: StoreConfig, marker: dict | None, txn: Any) -> dict:
        """The code to record in an index that has none: for a new directory (``marker``
        ``None``) the configured one (the defaults where unset); for a directory written
        before (its index from before the code was recorded, or its marker lost), what its
        marker records, ``ec_k``/``ec_m`` it lacks taken from the records, and the legacy
        ``ec_type`` for a marker that predates that field. Refused if ``config`` asks for
        another (``resolve_code``)."""
        if marker is not None:
            first = self.index.first_record(txn)
            if first is not None:
                marker = {"ec_k": first.k, "ec_m": first.m, **marker}
        resolved = self.resolve_code(config, marker)
        return {n: getattr(resolved, n) for n in ("ec_type", "ec_k", "ec_m")}

    def _write_marker(self, config: StoreConfig, identity: bytes, old: dict | None) -> None:
        """Write the marker (atomically and durably: temporary file, fsync, rename, directory
        fsync), keeping an existing one's creation time."""
        doc = {"format_version": DATA_FORMAT_VERSION,
               "created": old.get("created", time.time()) if old else time.time(),
               "ec_type": config.ec_type, "ec_k": config.ec_k, "ec_m": config.ec_m, "index_id": identity.hex()}
        recorded = _targets_record(config)
        if recorded:
            doc["targets"] = recorded
        write_marker_file(self.data_dir, doc)


def write_marker_file(data_dir: Path, doc: dict) -> None:
    """Write ``doc`` as ``data_dir``'s marker, atomically and durably: a temporary file in the
    directory, fsync, rename over the marker, fsync of the directory. A reader sees the old
    marker or the new one, never part of one; after a crash, one of them is on disk."""
    fmt = data_dir / FORMAT_FILE
    tmp = data_dir / f".{FORMAT_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(json.dumps(doc))
        fh.flush()
        os.fsync(fh.fileno())  # the bytes are on disk before the name points at them
    os.replace(tmp, fmt)
    fsync_dir(str(data_dir))  # the rename itself is durable


def format_refusal(data_dir: Path, version: int) -> str:
    """What an open of ``data_dir``, whose marker records format ``version`` (not this code's),
    says: for a version ``kvtool migrate`` takes (``MIGRATES_FROM``), how to migrate; for any
    other, that this release cannot read it."""
    if version in MIGRATES_FROM:
        return (f"data directory {data_dir} has format version {version}, this kvstore reads version "
                f"{DATA_FORMAT_VERSION} (pack files that grow by appends). Its files are valid version "
                f"{DATA_FORMAT_VERSION} files, but a kvstack release that reads version {version} may still be using "
                "it and assumes packs never grow: stop every process using the directory (daemons, engines with an "
                f"embedded store, kvtool), then run `kvtool migrate {data_dir}`, which checks it and rewrites "
                f"the format version in its {FORMAT_FILE} (no fragment is rewritten)")
    return (f"data directory {data_dir} has format version {version}, this kvstore reads "
            f"version {DATA_FORMAT_VERSION}; open it with a matching kvstack release or "
            "start a fresh directory")
