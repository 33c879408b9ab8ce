"""CRI AuthConfig → registry credentials, as containerd reads it."""

from __future__ import annotations

import base64

import pytest

from podgate.cri import api_pb2 as pb
from podgate.images.config import Credentials
from podgate.runtime.api import InvalidArgumentError
from podgate.runtime.cri.service import credentials_from_auth

REF = "registry.internal:5443/team/app:v1"


def test_username_password() -> None:
    auth = pb.AuthConfig(username="u", password="p", auth=base64.b64encode(b"x:y").decode())
    assert credentials_from_auth(auth, REF) == Credentials(username="u", password="p")


def test_identity_token() -> None:
    auth = pb.AuthConfig(identity_token="refresh")
    assert credentials_from_auth(auth, REF) == Credentials(identity_token="refresh")


def test_auth_field_is_base64_user_password() -> None:
    auth = pb.AuthConfig(auth=base64.b64encode(b"puller:s3:cret").decode())
    assert credentials_from_auth(auth, REF) == Credentials(username="puller", password="s3:cret")


@pytest.mark.parametrize("bad", ["!!!", base64.b64encode(b"no-colon").decode()])
def test_bad_auth_field(bad: str) -> None:
    with pytest.raises(InvalidArgumentError, match="base64 of user:password"):
        credentials_from_auth(pb.AuthConfig(auth=bad), REF)


def test_server_address_of_another_registry_is_not_used() -> None:
    auth = pb.AuthConfig(username="u", password="p", server_address="https://other.example:5000")
    assert credentials_from_auth(auth, REF) is None
    same = pb.AuthConfig(username="u", password="p", server_address="registry.internal:5443")
    assert credentials_from_auth(same, REF) == Credentials(username="u", password="p")
    hub = pb.AuthConfig(username="u", password="p", server_address="docker.io")
    assert credentials_from_auth(hub, "docker.io/library/busybox:latest") is not None
    legacy = pb.AuthConfig(username="u", password="p", server_address="https://index.docker.io/v1/")
    assert credentials_from_auth(legacy, "docker.io/library/busybox:latest") is not None


def test_no_auth() -> None:
    assert credentials_from_auth(pb.AuthConfig(), REF) is None
