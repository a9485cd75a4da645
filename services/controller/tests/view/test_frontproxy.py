"""The front proxy's user (request-header auth): read only with an allowed, verified client
certificate, from the header names the API server's ConfigMap gives."""

from __future__ import annotations

import json
from email.message import Message
from typing import Any

import pytest

from gpuslice_controller.view.frontproxy import ConfigWatch, RequestHeaderConfig, proxied_user
from gpuslice_kube.errors import KubeNotFoundError

pytestmark = pytest.mark.timeout(10)
CA = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----"
PROXY = {"subject": ((("organizationName", "x"),), (("commonName", "front-proxy-client"),))}


def configmap(**extra: str) -> dict[str, str]:
    return {
        "requestheader-client-ca-file": CA,
        "requestheader-allowed-names": json.dumps(["front-proxy-client"]),
        "requestheader-username-headers": json.dumps(["X-Remote-User"]),
        "requestheader-group-headers": json.dumps(["X-Remote-Group"]),
        "requestheader-extra-headers-prefix": json.dumps(["X-Remote-Extra-"]),
        **extra,
    }


def headers(*pairs: tuple[str, str]) -> Message:
    message = Message()
    for key, value in pairs:
        message[key] = value
    return message


def test_the_configmap_read_as_the_api_server_writes_it() -> None:
    config = RequestHeaderConfig.from_configmap(configmap())
    assert config is not None
    assert config.client_ca.startswith(b"-----BEGIN") and config.allowed_names == {
        "front-proxy-client"
    }
    assert config.username_headers == ("X-Remote-User",)
    assert RequestHeaderConfig.from_configmap({"client-ca-file": CA}) is None
    with pytest.raises(ValueError, match="requestheader-allowed-names is not a JSON list"):
        RequestHeaderConfig.from_configmap(configmap(**{"requestheader-allowed-names": "a,b"}))


def test_user_groups_and_extra_from_the_headers() -> None:
    config = RequestHeaderConfig.from_configmap(configmap())
    request = headers(
        ("X-Remote-User", "alice"),
        ("X-Remote-Group", "devs"),
        ("X-Remote-Group", "system:authenticated"),
        ("X-Remote-Extra-Scopes", "a,b"),
        ("X-Remote-Extra-Authentication.kubernetes.io%2fnode-name", "n1"),
    )
    user = proxied_user(config, PROXY, request)
    assert user is not None
    assert user.as_obj() == {
        "username": "alice",
        "groups": ["devs", "system:authenticated"],
        "extra": {"scopes": ["a", "b"], "authentication.kubernetes.io/node-name": ["n1"]},
    }


@pytest.mark.parametrize(
    "peercert",
    [
        None,  # a connection without TLS client authentication
        {},  # ssl's getpeercert() when no certificate was presented (or it was not verified)
        {"subject": ((("commonName", "someone"),),)},  # signed by the CA, but not allowed
    ],
)
def test_headers_are_never_trusted_without_an_allowed_verified_certificate(
    peercert: dict[str, Any] | None,
) -> None:
    config = RequestHeaderConfig.from_configmap(configmap())
    forged = headers(("X-Remote-User", "system:admin"), ("X-Remote-Group", "system:masters"))
    assert proxied_user(config, peercert, forged) is None
    assert proxied_user(None, PROXY, forged) is None  # no front proxy configured at all


def test_any_name_of_the_ca_when_no_names_are_listed() -> None:
    config = RequestHeaderConfig.from_configmap(configmap(**{"requestheader-allowed-names": ""}))
    other = {"subject": ((("commonName", "someone"),),)}
    assert proxied_user(config, other, headers(("X-Remote-User", "bob"))) is not None
    assert proxied_user(config, other, headers()) is None  # and no user header: nobody


class Raw:
    def __init__(self, data: dict[str, str] | None) -> None:
        self.data = data

    def get(self, path: str) -> dict[str, Any]:
        assert (
            path == "/api/v1/namespaces/kube-system/configmaps/extension-apiserver-authentication"
        )
        if self.data is None:
            raise KubeNotFoundError("not found")
        return {"data": self.data}


def test_the_watch_hands_changes_to_the_server() -> None:
    raw = Raw(configmap())
    seen: list[RequestHeaderConfig | None] = []
    watch = ConfigWatch(raw, seen.append)  # type: ignore[arg-type]
    watch.load()
    watch.load()  # unchanged: not handed again
    raw.data = None
    watch.load()
    assert [c is not None for c in seen] == [True, False]
