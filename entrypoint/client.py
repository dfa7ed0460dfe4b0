"""A small synchronous client of ``Entrypoint.Generate`` (``proto/serving.proto``).

``Client(address).generate(token_ids)`` sends one request and collects its stream: the tokens,
the hop events (``entrypoint.generate``) and the final summary. It is what the walkthrough, the
end-to-end tests and a quick manual check use; a serving stack's own clients speak the same
gRPC service.
"""

from __future__ import annotations

import json

from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.tls import ChannelTLS, open_channel


class Client:
    """A small synchronous client of ``Entrypoint.Generate``; ``token``: its client token, if the
    entrypoint has client tokens (``entrypoint.client_tokens``).

    TLS (``entrypoint.tls``): ``address`` ``grpcs://HOST:PORT`` (what a TLS entrypoint's READY
    says) is TLS, verified with ``ca_file`` (empty: the system roots); ``cert_file`` +
    ``key_file``: the client certificate for an entrypoint with ``--tls-client-ca``. TLS files
    with a plaintext address are ``InvalidRequest``, before any channel is opened."""

    def __init__(self, address: str, token: str = "", *, ca_file: str = "", cert_file: str = "",
                 key_file: str = ""):
        self.channel = open_channel(address, ChannelTLS(ca_file, cert_file, key_file))
        self.stub = pbg.EntrypointStub(self.channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()

    def generate(self, token_ids: list[int], *, max_new_tokens: int = 8, images: list[pb.ImageSegment] = (),
                 tenant: str = "", temperature: float = 0.0, seed: int = 0, request_id: str = "",
                 on_event=None, timeout: float | None = 300.0) -> tuple[list[int], list[dict], dict]:
        """(tokens, hop events, summary). ``on_event(event)`` sees every event as it arrives."""
        req = pb.GenerateRequest(request_id=request_id, token_ids=token_ids, images=list(images), tenant=tenant,
                                 sampling=pb.Sampling(max_new_tokens=max_new_tokens, temperature=temperature,
                                                      seed=seed))
        tokens, hops, summary = [], [], {}
        for ev in self.stub.Generate(req, timeout=timeout, metadata=self._metadata):
            if on_event is not None:
                on_event(ev)
            if ev.kind == "token":
                tokens.append(ev.token_id)
            elif ev.kind == "hop":
                hops.append(dict(json.loads(ev.detail), t_ms=ev.t_ms))
            elif ev.kind == "done":
                summary = json.loads(ev.detail)
        return tokens, hops, summary

    def close(self) -> None:
        self.channel.close()
