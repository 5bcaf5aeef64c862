"""A registry (distribution API v2) read for `boxd.images.oci`: manifests and blobs,
with bearer-token or basic authentication."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx

from boxd.errors import AuthError, InvalidRequest, NotFound
from boxd.storage.oci import MANIFEST_MEDIA, Descriptor

from ._oci_parts import ACCEPT, INDEXES, Source, docker_credentials, manifest_json, pick

__all__ = ["RegistryReader"]

_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
TIMEOUT = httpx.Timeout(30.0, connect=10.0)


class RegistryReader:
    """One image of a registry: ``manifest()`` then ``blob(desc)`` for each blob."""

    def __init__(self, src: Source, *, creds: str | None, insecure: bool) -> None:
        self.src = src
        scheme = "http" if insecure else "https"
        self.base = f"{scheme}://{src.host}/v2/{src.repo}"
        if creds is not None:
            user, sep, pw = creds.partition(":")
            if not sep:
                raise InvalidRequest("--creds takes USER:PASSWORD")
            self.auth: tuple[str, str] | None = (user, pw)
        else:
            self.auth = docker_credentials(src.host)
        self.client = httpx.Client(timeout=TIMEOUT, follow_redirects=True)
        self.token: str | None = None

    def close(self) -> None:
        self.client.close()

    def manifest(self) -> tuple[bytes, str]:
        raw, media = self._manifest(self.src.reference)
        if media in INDEXES:
            entry = Descriptor.parse(pick(manifest_json(raw, "index"), None, str(self.src)))
            raw, media = self._manifest(entry.digest)
        return raw, media or MANIFEST_MEDIA

    def _manifest(self, reference: str) -> tuple[bytes, str]:
        r = self._get(f"{self.base}/manifests/{reference}", headers={"Accept": ACCEPT})
        try:
            if len(r.content) > 4 << 20:
                raise InvalidRequest(f"{self.src}: the manifest is over 4 MiB")
            return r.content, r.headers.get("content-type", "").split(";")[0].strip()
        finally:
            r.close()

    def blob(self, desc: Descriptor) -> Iterator[bytes]:
        r = self._get(f"{self.base}/blobs/{desc.digest}", stream=True)
        try:
            yield from r.iter_bytes(1 << 20)
        except httpx.HTTPError as exc:
            raise InvalidRequest(f"the registry {self.src.host} broke off {desc.digest}: "
                                 f"{exc}", hint="import again: stored layers are kept") from None
        finally:
            r.close()

    def _headers(self) -> dict[str, str]:
        if self.token is not None:
            return {"Authorization": f"Bearer {self.token}"}
        return {}

    def _get(self, url: str, headers: dict[str, str] | None = None,
             stream: bool = False) -> httpx.Response:
        for attempt in range(2):
            try:
                req = self.client.build_request("GET", url, headers={**(headers or {}),
                                                                     **self._headers()})
                r = self.client.send(req, stream=stream,
                                     auth=self.auth if self.token is None else None)
            except httpx.HTTPError as exc:
                raise InvalidRequest(
                    f"cannot reach the registry {self.src.host}: {exc}",
                    hint="check the host and port; a registry without TLS needs "
                         "--insecure") from None
            if r.status_code == 401 and attempt == 0 and self._login(r):
                r.close()
                continue
            self._check(r, url)
            return r
        raise AssertionError("unreachable")

    def _login(self, r: httpx.Response) -> bool:
        """Answer a bearer challenge with a token (basic auth was already tried)."""
        challenge = r.headers.get("www-authenticate", "")
        if not challenge.lower().startswith("bearer"):
            return False
        params = dict(_CHALLENGE.findall(challenge))
        realm = params.pop("realm", "")
        if not realm:
            return False
        try:
            t = self.client.get(realm, params=params, auth=self.auth)
        except httpx.HTTPError as exc:
            raise AuthError(f"cannot reach the token service {realm}: {exc}") from None
        if t.status_code != 200:
            raise AuthError(
                f"the registry {self.src.host} refused the credentials for "
                f"{self.src.repo} (HTTP {t.status_code})",
                hint="pass --creds USER:PASSWORD or `docker login` to the registry")
        body = t.json() if t.headers.get("content-type", "").startswith("application/json") \
            else {}
        token = body.get("token") or body.get("access_token")
        self.token = str(token) if token else None
        return self.token is not None

    def _check(self, r: httpx.Response, url: str) -> None:
        if r.status_code < 400:
            return
        if r.status_code == 401:
            raise AuthError(f"the registry {self.src.host} needs credentials for "
                            f"{self.src.repo}",
                            hint="pass --creds USER:PASSWORD or `docker login` to it")
        if r.status_code == 404:
            raise NotFound(f"{self.src} does not exist on the registry ({url})",
                           hint="check the repository and tag")
        raise InvalidRequest(f"the registry answered HTTP {r.status_code} for {url}")
