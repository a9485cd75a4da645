"""Bearer tokens checked by TokenReview and SubjectAccessReview, positive answers cached."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from gpuslice_controller.view.auth import Authorizer, Reviewer, bearer
from gpuslice_kube.errors import KubeTransientError
from gpuslice_kube.raw import Obj

pytestmark = pytest.mark.timeout(10)


class FakeReviewer(Reviewer):
    """Tokens ``good-*`` authenticate as user ``*``; users in ``allowed`` may read the view."""

    def __init__(self) -> None:
        self.allowed = {"alice"}
        self.calls: list[str] = []
        self.down = False
        self.where: dict[str, str] = {}

    def token_review(self, token: str) -> Obj:
        self.calls.append("token")
        if self.down:
            raise KubeTransientError("the API server is down")
        if not token.startswith("good-"):
            return {"status": {"authenticated": False, "error": "invalid bearer token"}}
        user = token.removeprefix("good-")
        return {"status": {"authenticated": True, "user": {"username": user, "groups": ["g"]}}}

    def access_review(
        self, user: Obj, group: str = "gpu.gpuslice.dev", verb: str = "get", **where: str
    ) -> Obj:
        self.calls.append("access" if (group, verb) == ("gpu.gpuslice.dev", "get") else verb)
        self.where = where
        if self.down:
            raise KubeTransientError("the API server is down")
        return {"status": {"allowed": user["username"] in self.allowed}}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def reviewer() -> FakeReviewer:
    return FakeReviewer()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def auth(reviewer: FakeReviewer, clock: Clock) -> Authorizer:
    return Authorizer(reviewer, ttl=10, max_entries=3, clock=clock)


def test_bearer_header_parsing() -> None:
    assert bearer("Bearer abc") == "abc"
    assert bearer("bearer  abc ") == "abc"
    assert bearer("Basic abc") == ""
    assert bearer(None) == "" and bearer("") == "" and bearer("Bearer") == ""


def test_no_token_or_a_bad_one_is_401_and_asks_no_access_review(
    auth: Authorizer, reviewer: FakeReviewer
) -> None:
    assert auth.check(None).status == HTTPStatus.UNAUTHORIZED
    assert reviewer.calls == []
    assert auth.check("Bearer nope").status == HTTPStatus.UNAUTHORIZED
    assert reviewer.calls == ["token"]


def test_without_the_permission_is_403_naming_it(auth: Authorizer) -> None:
    decision = auth.check("Bearer good-bob")
    assert decision.status == HTTPStatus.FORBIDDEN
    assert '"bob" cannot get resource "gpus" in API group "gpu.gpuslice.dev"' in decision.message


def test_a_positive_review_is_cached_for_the_ttl(
    auth: Authorizer, reviewer: FakeReviewer, clock: Clock
) -> None:
    assert auth.check("Bearer good-alice").status == HTTPStatus.OK
    assert reviewer.calls == ["token", "access"]
    clock.now += 9.9
    decision = auth.check("Bearer good-alice")
    assert decision.allowed and decision.user == "alice"
    assert reviewer.calls == ["token", "access"]  # from the cache
    reviewer.allowed.clear()  # revoked: seen once the entry expires
    clock.now += 0.2
    assert auth.check("Bearer good-alice").status == HTTPStatus.FORBIDDEN
    assert reviewer.calls == ["token", "access"] * 2


def test_refusals_are_not_cached_so_a_grant_takes_effect_at_once(
    auth: Authorizer, reviewer: FakeReviewer
) -> None:
    assert auth.check("Bearer good-bob").status == HTTPStatus.FORBIDDEN
    reviewer.allowed.add("bob")
    assert auth.check("Bearer good-bob").status == HTTPStatus.OK


def test_the_cache_is_bounded_and_keyed_by_a_hash(
    auth: Authorizer, reviewer: FakeReviewer, clock: Clock
) -> None:
    reviewer.allowed |= {"u1", "u2", "u3", "u4"}
    for user in ("u1", "u2", "u3", "u4"):
        assert auth.check(f"Bearer good-{user}").allowed
    assert len(auth) == 3
    assert not any("good-" in key for key in auth._cache)
    calls = len(reviewer.calls)
    assert auth.check("Bearer good-u1").allowed  # the oldest went; reviewed again
    assert len(reviewer.calls) == calls + 2
    clock.now += 11
    reviewer.allowed.add("u5")
    assert auth.check("Bearer good-u5").allowed
    assert len(auth) == 1  # expired entries are dropped on insertion


def test_an_api_server_that_cannot_review_is_503(auth: Authorizer, reviewer: FakeReviewer) -> None:
    reviewer.down = True
    assert auth.check("Bearer good-alice").status == HTTPStatus.SERVICE_UNAVAILABLE
    reviewer.down = False
    assert auth.check("Bearer good-alice").allowed


def test_the_access_review_asks_for_the_stated_permission() -> None:
    sent: list[tuple[str, Obj]] = []

    class Raw:
        def create(self, path: str, obj: Obj) -> Obj:
            sent.append((path, obj))
            return {}

    Reviewer(Raw()).access_review(  # type: ignore[arg-type]
        {"username": "system:serviceaccount:a:b", "uid": "u", "groups": ["g"]}
    )
    [(path, body)] = sent
    assert path == "/apis/authorization.k8s.io/v1/subjectaccessreviews"
    assert body["spec"] == {
        "user": "system:serviceaccount:a:b",
        "uid": "u",
        "groups": ["g"],
        "resourceAttributes": {"group": "gpu.gpuslice.dev", "resource": "gpus", "verb": "get"},
    }


def test_a_user_the_api_server_authenticated_is_reviewed_per_verb_and_cached(
    auth: Authorizer, reviewer: FakeReviewer, clock: Clock
) -> None:
    alice = {"username": "alice", "groups": ["g"]}
    assert auth.check_user(alice, group="view.gpuslice.dev", verb="list").allowed
    assert auth.check_user(alice, group="view.gpuslice.dev", verb="list").allowed
    assert auth.check_user(alice, group="view.gpuslice.dev", verb="watch").allowed
    assert reviewer.calls == ["list", "watch"]  # one review per question within the ttl
    refused = auth.check_user({"username": "bob"}, group="view.gpuslice.dev", verb="get")
    assert refused.status == HTTPStatus.FORBIDDEN
    assert (
        'User "bob" cannot get resource "gpus" in API group "view.gpuslice.dev"' in refused.message
    )
    clock.now += 11
    reviewer.down = True
    down = auth.check_user(alice, group="view.gpuslice.dev", verb="list")
    assert down.status == HTTPStatus.SERVICE_UNAVAILABLE


def test_a_namespaced_question_names_the_namespace_and_object_in_the_review(
    auth: Authorizer, reviewer: FakeReviewer
) -> None:
    sent: list[Obj] = []

    class Raw:
        def create(self, path: str, obj: Obj) -> Obj:
            sent.append(obj)
            return {}

    Reviewer(Raw()).access_review(  # type: ignore[arg-type]
        {"username": "u"},
        "view.gpuslice.dev",
        "get",
        resource="gpuclaims",
        namespace="ml",
        name="a",
    )
    assert sent[0]["spec"]["resourceAttributes"] == {
        "group": "view.gpuslice.dev",
        "resource": "gpuclaims",
        "verb": "get",
        "namespace": "ml",
        "name": "a",
    }
    bob = {"username": "bob"}
    where = {"resource": "gpuclaims", "namespace": "ml", "name": "a"}
    refused = auth.check_user(bob, group="view.gpuslice.dev", verb="get", **where)
    assert reviewer.where == where
    assert refused.message == (
        'gpuclaims.view.gpuslice.dev "a" is forbidden: User "bob" cannot get resource '
        '"gpuclaims" in API group "view.gpuslice.dev" in the namespace "ml"'
    )
    alice = {"username": "alice"}
    assert auth.check_user(alice, group="view.gpuslice.dev", verb="list", namespace="ml").allowed
    assert auth.check_user(alice, group="view.gpuslice.dev", verb="list", namespace="x").allowed
    assert reviewer.calls[-2:] == ["list", "list"]  # another namespace is another question
