"""User, group and supplemental groups resolved as containerd does (reference §5.2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from podgate.oci import users

PASSWD = "root:x:0:0::/root:/bin/sh\nwww-data:x:33:33::/:/bin/false\nuser:x:1000:1000::/:/bin/sh\n"
GROUP = "root:x:0:\nstaff:x:50:user\nuser:x:1000:user\npredef:x:50000:user,other\n"


@pytest.mark.parametrize(
    ("user", "uid", "gid"),
    [
        ("", 0, 0),
        ("1000", 1000, 1000),
        ("1001", 1001, 0),  # no passwd entry: gid 0
        ("www-data", 33, 33),
        ("1003:1004", 1003, 1004),
        ("www-data:1004", 33, 1004),
        ("1003:staff", 1003, 50),
    ],
)
def test_resolve(user: str, uid: int, gid: int) -> None:
    identity = users.resolve(user, PASSWD, GROUP)
    assert (identity.uid, identity.gid) == (uid, gid)


def test_missing_names_and_files() -> None:
    with pytest.raises(users.UserError, match="no users found"):
        users.resolve("nobody", PASSWD, GROUP)
    with pytest.raises(users.UserError, match="no groups found"):
        users.resolve("1:nogroup", PASSWD, GROUP)
    assert users.resolve("1001", None, None) == users.Identity(1001, 0, (0,))


def test_supplemental_groups_merge_and_strict() -> None:
    # critest's predefined-group case: uid 1000, groups [1234].
    merged = users.resolve("1000", PASSWD, GROUP, [1234])
    assert merged.additional_gids == (50, 1000, 1234, 50000)  # "user" group itself skipped
    strict = users.resolve("1000", PASSWD, GROUP, [1234], strict=True)
    assert strict.additional_gids == (1000, 1234)
    assert users.resolve("1001", PASSWD, GROUP, [7]).additional_gids == (0, 7)


def test_user_string() -> None:
    assert users.user_string("", None, None, "img:5") == "img:5"
    assert users.user_string("nobody", 5, None, "img") == "nobody"
    assert users.user_string("", 5, 6, "img") == "5:6"
    with pytest.raises(users.UserError, match='user group "6" is specified without user'):
        users.user_string("", None, 6, "img")


def test_files_are_read_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    outside = tmp_path / "outside-passwd"
    outside.write_text("evil:x:7:7::/:/bin/sh\n")
    (root / "etc" / "passwd").symlink_to(outside)  # absolute: resolved inside the root
    (root / "etc" / "group").write_text(GROUP)
    passwd, group = users.read_user_files(str(root))
    assert passwd is None and group == GROUP
