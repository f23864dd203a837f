"""The server's own endpoints: health, server and model info, the model list, metrics, and
emptying the prefix cache."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lifecycle import SamplingParams
from scheduler.messages import FAKE_BOOTSTRAP_HOST
from scheduler.service.core import Service, Unavailable
from scheduler.service.errors import error, failure_kind, openai_error, unavailable
from scheduler.service.metrics import DP_RANK, replicated_text
from scheduler.service.openai_schema import OpenAIError
from scheduler.service.schema import ERRORS, ModelCard, ModelInfo, ModelList, ServerInfo

_HEALTH_TIMEOUT_S = 30.0
#: How long /flush_cache waits for the engines' next pass.
_FLUSH_TIMEOUT_S = 30.0

router = APIRouter()


def service_of(request: Request) -> Service:
    """The :class:`Service` an app serves (every route's dependency)."""
    service: Service = request.app.state.service
    return service


ServiceDep = Annotated[Service, Depends(service_of)]


@router.get("/health", response_class=PlainTextResponse, responses={503: ERRORS[503]})
async def health(service: ServiceDep) -> Response:
    """200 (empty body) while the engine loop runs and the server admits requests."""
    return unavailable(service) or PlainTextResponse("")


# Some load balancers probe with HEAD; one operation in the schema is enough.
router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False,
                     response_class=PlainTextResponse)


@router.get("/health_generate", response_class=PlainTextResponse, responses={503: ERRORS[503]})
async def health_generate(service: ServiceDep) -> Response:
    """Runs a one-token request through the engines (fake bootstrap host)."""
    refused = unavailable(service)
    if refused is not None:
        return refused
    item = service.check(
        rid=f"health-{uuid.uuid4().hex}", input_ids=service.tokenizer.encode("health"),
        sampling=SamplingParams(1, ignore_eos=True),
        bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_port=None, bootstrap_room=None,
    )
    try:
        pending = service.start(item, stream=False)
    except Unavailable as exc:
        return error(503, "unavailable", str(exc))
    try:
        answer = await asyncio.wait_for(asyncio.shield(pending.future), _HEALTH_TIMEOUT_S)
    except TimeoutError:
        service.abort(item.rid)
        return error(503, "timeout", f"no answer within {_HEALTH_TIMEOUT_S:g} s")
    if answer.status != 200:
        return error(503, failure_kind(answer), answer.message)
    return PlainTextResponse("")


def _server_info(service: ServiceDep) -> ServerInfo:
    config, snap = service.config, service.snapshot
    requests, kv_pool = snap.get("requests", {}), snap.get("kv_pool", {})
    if _replicated(service) and "prefill" in requests and "prefill" in kv_pool:
        requests, kv_pool = _by_replica(service, requests["prefill"], kv_pool["prefill"])
    return ServerInfo(
        role=config.role,
        backend=config.backend,
        disaggregation_mode=config.role if config.role != "both" else "null",
        model_path=_model_path(service),
        model_fingerprint=_fingerprint(service),
        page_size=config.scheduler.page_size,
        kv_layout=str(config.kv_layout),
        pool_pages=config.pool_pages,
        metadata_slots=config.metadata_slots,
        max_new_tokens_limit=config.new_tokens_limit,
        max_position=config.max_position,
        bootstrap_port=(
            int(service.bootstrap.address.rpartition(":")[2])
            if service.bootstrap is not None else None
        ),
        tp_size=config.tp_size,
        pp_size=config.pp_size,
        dp_size=config.dp_size,
        rank_processes=config.tp_size * config.pp_size * config.dp_size,
        healthy=service.healthy,
        draining=service.draining,
        live_requests=service.live_requests(),
        connecting=service.connecting(),
        requests=requests,
        kv_pool=kv_pool,
        peers=_peers(service),
    )


def _replicated(service: Service) -> bool:
    """Whether ``service`` is a prefill of several DP replicas, whose figures /metrics and
    /server_info gather (:mod:`scheduler.service.metrics`)."""
    return service.config.dp_size > 1 and service.prefill is not None


#: The gauges of another replica's /server_info figures.
_REPLICA_GAUGES = ("pdlife_requests", "pdlife_kv_pool_pages", "pdlife_kv_pages_used",
                   "pdlife_prefix_cache_pages", "pdlife_prefix_cache_evictable_pages")


def _by_replica(
    service: Service, requests: dict[str, int], pool: dict[str, int],
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """A DP server's requests by state and KV pool: the whole server's under ``prefill`` (the
    sums over the replicas whose figures are known), then each replica's under
    ``prefill/dp<rank>``: replica 0's from rank 0's last pass (``requests``, ``pool``), the
    others' from the gauges of their last answer to a scrape (this waits up to
    :data:`~scheduler.service.metrics.REPLICA_WAIT_S` for them: the route runs on a worker
    thread)."""
    # Another replica's gauge, by name, then by its state label ("" for none).
    gauges: dict[int, dict[str, dict[str, float]]] = {}
    for family in service.metrics.registry.collect():
        if family.name in _REPLICA_GAUGES:
            for sample in family.samples:
                if DP_RANK in sample.labels:
                    by_name = gauges.setdefault(int(sample.labels[DP_RANK]), {})
                    by_name.setdefault(family.name, {})[sample.labels.get("state", "")] = (
                        sample.value)
    replicas = {0: (requests, pool)}
    for rank, by_name in sorted(gauges.items()):
        def gauge(name: str, of: dict[str, dict[str, float]] = by_name) -> int:
            return int(of.get(name, {}).get("", 0))

        total = gauge("pdlife_kv_pool_pages")
        # As rank 0's pool view: prefix-cache pages nobody locks count as free.
        used = gauge("pdlife_kv_pages_used") - gauge("pdlife_prefix_cache_evictable_pages")
        view = {"free_pages": total - used, "used_pages": used, "total_pages": total}
        if "prefix_cache_pages" in pool:
            view["prefix_cache_pages"] = gauge("pdlife_prefix_cache_pages")
        states = {state: int(n) for state, n in by_name.get("pdlife_requests", {}).items()}
        replicas[rank] = (states, view)
    by_state: dict[str, int] = {}
    summed: dict[str, int] = {}
    for states, view in replicas.values():
        for key, n in states.items():
            by_state[key] = by_state.get(key, 0) + n
        for key, n in view.items():
            summed[key] = summed.get(key, 0) + n
    return ({"prefill": by_state, **{f"prefill/dp{r}": s for r, (s, _) in replicas.items()}},
            {"prefill": summed, **{f"prefill/dp{r}": v for r, (_, v) in replicas.items()}})


def _peers(service: Service) -> list[str]:
    """Decode: the prefill servers it is connected to; prefill over Mooncake: the decode
    sessions registered with it (rank 0's: every decode rank registers with every rank)."""
    if service.decode_kv is not None:
        return service.decode_kv.peers()
    sessions = getattr(service.prefill.kv, "decode_sessions", None) if service.prefill else None
    return list(sessions()) if sessions is not None else []


def _fingerprint(service: Service) -> str | None:
    """What names the served model's KV (:mod:`kv.model_id`; the reference model's too, whose
    configuration decides every weight): its engine's pool carries it."""
    engine = service.prefill if service.prefill is not None else service.decode
    served = service.config.served
    model: str = (served.fingerprint if served is not None
                  else engine.pool.model if engine is not None else "")
    return model or None


def _model_path(service: Service) -> str:
    """SGLang's ``model_path``: what ``--model-path`` loaded (the served name,
    ``--served-model-name``, is ``/v1/models``' id); here what ``--model`` loaded, a path or a
    built-in name."""
    from scheduler.model.select import REFERENCE

    served = service.config.served
    return served.name if served is not None else REFERENCE


def _model_info(service: ServiceDep) -> ModelInfo:
    config, served = service.config, service.config.served
    own = served is not None and not served.is_reference  # the checkpoint's own tokenizer
    return ModelInfo(
        model_path=_model_path(service),
        tokenizer_path=served.name if own else None,
        is_generation=True,
        vocab_size=config.vocab_size, max_position=config.max_position,
    )


for _path in ("/server_info", "/get_server_info"):
    router.get(_path, response_model=ServerInfo)(_server_info)
for _path in ("/model_info", "/get_model_info"):
    router.get(_path, response_model=ModelInfo)(_model_info)

_STARTED = int(time.time())


@router.get("/v1/models", response_model=ModelList)
async def models(service: ServiceDep) -> ModelList:
    config = service.config
    return ModelList(data=[ModelCard(
        id=config.model_name, created=_STARTED, owned_by="pdlife", root=config.model_name,
        max_model_len=config.max_request_tokens,
    )])


@router.get("/v1/models/{model:path}", response_model=ModelCard,
            responses={404: {"model": OpenAIError, "description": "not the served model"}})
async def model(model: str, service: ServiceDep) -> ModelCard | JSONResponse:
    """OpenAI's model retrieval: the served model's card (its name may hold slashes: a path,
    ``org/name``); another name is 404."""
    if model != service.config.model_name:
        return openai_error(404, f"the model {model!r} does not exist: this worker serves "
                            f"{service.config.model_name!r}", "model_not_found", "model")
    return (await models(service)).data[0]


@router.post(
    "/flush_cache", response_class=PlainTextResponse,
    responses={400: {"description": "requests were live, or had ended with their KV transfer "
                                    "still running: the cache was not (all) emptied",
                     "content": {"text/plain": {}}}, 503: ERRORS[503]})
async def flush_cache(service: ServiceDep) -> Response:
    """SGLang's: empty the prefix cache (every DP replica's), so that what follows starts
    cold. Only when no request is live and no ended request's KV transfer still reads cached
    pages (400 otherwise, as SGLang: retry when idle); a decode worker, or a prefill with the
    cache off, has nothing to empty (200)."""
    refused = unavailable(service)
    if refused is not None:
        return refused
    asked = service.flush_cache()
    if not asked:
        return PlainTextResponse("No prefix cache on this worker (a decode worker keeps "
                                 "none).\n")
    try:
        outcomes = await asyncio.wait_for(
            asyncio.gather(*map(asyncio.wrap_future, asked)), _FLUSH_TIMEOUT_S)
    except TimeoutError:
        return error(503, "unavailable", f"the engines did not run the flush within "
                     f"{_FLUSH_TIMEOUT_S:.0f} s")
    if not service.config.scheduler.radix_cache:
        return PlainTextResponse("The prefix cache is off (--disable-radix-cache): nothing "
                                 "to flush.\n")
    pages = sum(o.pages for o in outcomes)
    # ``live`` counts live requests and ended ones whose KV transfer still reads cached pages.
    busy = [(i, o.live) for i, o in enumerate(outcomes) if not o.flushed]
    if len(outcomes) == 1 and busy:
        live = busy[0][1]
        who = ("1 request is live (or ended with its KV transfer still running)" if live == 1
               else f"{live} requests are live (or ended with their KV transfer still running)")
        return PlainTextResponse(f"Cache not flushed: {who}; flush it when the server is "
                                 "idle.\n", status_code=400)
    if busy:
        where = ", ".join(f"replica {i}: {live}" for i, live in busy)
        return PlainTextResponse(
            f"Cache not flushed on every replica (requests live, or ended with their KV "
            f"transfer still running: {where}); flush it when the server is idle. "
            f"{len(outcomes) - len(busy)} of {len(outcomes)} replicas flushed, {pages} "
            "pages back in the KV pool.\n", status_code=400)
    return PlainTextResponse(f"Cache flushed: {pages} pages back in the KV pool.\n")


# SGLang's route takes GET too; one operation in the schema is enough.
router.add_api_route("/flush_cache", flush_cache, methods=["GET"], include_in_schema=False,
                     response_class=PlainTextResponse)


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(service: ServiceDep) -> Response:
    """Prometheus text: scheduler, decode and HTTP metrics; on a prefill of several DP
    replicas, every replica's scheduler's, labelled ``dp_rank`` (read on a worker thread: the
    other replicas have up to :data:`~scheduler.service.metrics.REPLICA_WAIT_S` to answer)."""
    registry = service.metrics.registry
    text = (await asyncio.to_thread(replicated_text, registry) if _replicated(service)
            else generate_latest(registry))
    return Response(text, media_type=CONTENT_TYPE_LATEST)
