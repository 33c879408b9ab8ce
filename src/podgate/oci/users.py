"""A container's uid, gid and supplemental groups, resolved in its rootfs as containerd does.

The user string is `run_as_username`, else `run_as_user`, with `:run_as_group` appended, else
the image's `User`; it is looked up in the rootfs's `/etc/passwd` and `/etc/group` (read
inside the root, so a symlinked `/etc/passwd` cannot reach the host's). `resolve` is pure;
`read_user_files` does the reading.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from podgate.oci.securejoin import read_in_root

__all__ = [
    "MAX_ID_FILE_BYTES",
    "Identity",
    "UserError",
    "read_user_files",
    "resolve",
    "user_string",
]

# /etc/passwd and /etc/group are read up to this size, bytes (bigger files are cut there).
MAX_ID_FILE_BYTES: Final = 4 * 1024 * 1024


class UserError(ValueError):
    """The user cannot be resolved; the message is containerd's wording."""


@dataclass(frozen=True, slots=True)
class Identity:
    uid: int
    gid: int
    additional_gids: tuple[int, ...] = ()
    username: str = ""  # the passwd name, when there is one


def user_string(
    run_as_username: str, run_as_user: int | None, run_as_group: int | None, image_user: str
) -> str:
    """The user spec containerd builds from the security context and the image."""
    user = run_as_username or ("" if run_as_user is None else str(run_as_user))
    if run_as_group is not None:
        if not user:
            raise UserError(f'user group "{run_as_group}" is specified without user')
        user += f":{run_as_group}"
    return user or image_user


@dataclass(frozen=True, slots=True)
class _Passwd:
    name: str
    uid: int
    gid: int


@dataclass(frozen=True, slots=True)
class _Group:
    name: str
    gid: int
    members: tuple[str, ...]


def _parse_passwd(text: str) -> list[_Passwd]:
    entries = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) < 4 or line.startswith("#"):
            continue
        try:
            entries.append(_Passwd(fields[0], int(fields[2]), int(fields[3])))
        except ValueError:
            continue
    return entries


def _parse_group(text: str) -> list[_Group]:
    entries = []
    for line in text.splitlines():
        fields = line.split(":")
        if len(fields) < 3 or line.startswith("#"):
            continue
        try:
            gid = int(fields[2])
        except ValueError:
            continue
        members = tuple(m for m in (fields[3].split(",") if len(fields) > 3 else []) if m)
        entries.append(_Group(fields[0], gid, members))
    return entries


def _as_id(text: str) -> int | None:
    return int(text) if text.isdigit() else None


def resolve(
    user: str,
    passwd: str | None,
    group: str | None,
    supplemental: Sequence[int] = (),
    *,
    strict: bool = False,
) -> Identity:
    """uid/gid/groups for `user` given the rootfs's passwd and group texts (None = no file).

    Supplemental groups (policy Merge): the image's groups naming the user, plus
    `supplemental`, plus the primary gid, sorted; Strict leaves out the image's groups.
    """
    users = _parse_passwd(passwd or "")
    groups = _parse_group(group or "")
    name_part, _, group_part = user.partition(":")
    uid = 0
    gid = 0
    username = ""
    if name_part:
        number = _as_id(name_part)
        if number is not None:
            uid = number
            entry = next((u for u in users if u.uid == uid), None)
        else:
            entry = next((u for u in users if u.name == name_part), None)
            if entry is None:
                raise UserError(f"unable to find user {name_part}: no users found")
            uid = entry.uid
        if entry is not None:
            gid, username = entry.gid, entry.name
    if group_part:
        number = _as_id(group_part)
        if number is not None:
            gid = number
        else:
            found = next((g for g in groups if g.name == group_part), None)
            if found is None:
                raise UserError(f"unable to find group {group_part}: no groups found")
            gid = found.gid
    extra: set[int] = {gid, *supplemental}
    if not strict and username:
        extra.update(g.gid for g in groups if username in g.members and g.name != username)
    return Identity(uid, gid, tuple(sorted(extra)), username)


def read_user_files(rootfs: str) -> tuple[str | None, str | None]:
    """(passwd, group) texts of a rootfs; None for a file that is missing or unreadable."""
    texts: list[str | None] = []
    for path in ("/etc/passwd", "/etc/group"):
        try:
            texts.append(read_in_root(rootfs, path, MAX_ID_FILE_BYTES).decode("utf-8", "replace"))
        except OSError:
            texts.append(None)
    return texts[0], texts[1]
