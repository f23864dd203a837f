"""``pdlife serve --tp-size --pp-size --dp-size``: a prefill of rank processes behind one HTTP
front.

One server of the reference model on two DP replicas of PP 2 (four processes, fake backend)
answers a batch with the colocated model's first tokens (the fake backend's rooms count up, so
the requests alternate between the replicas), shows its pool free again, counts each
replica's requests on /metrics (labelled ``dp_rank``) and /server_info, answers both within a
bounded wait while its rank processes are stopped (SIGSTOP), with the stopped replica's last
figures and ``pdlife_dp_replica_up`` 0, and exits 0 on SIGTERM with its rank processes stopped
by rank 0; so do two DP replicas of SmolLM2. SGLang's
router drives a prefill of two DP replicas of TP 2 and a decode at TP 1 over Mooncake to the
colocated outputs (the decode finds each room's replica as the prefill routes it), and SmolLM2
at TP 3 on both sides (the decode's three rank processes decoding in lockstep; it exits 0 on
SIGTERM with its ranks stopped).
The flags are checked before anything starts, with errors that say what to change.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from kv.listeners import listening
from scheduler.cli.command import UsageError
from scheduler.cli.serve import SERVE, serve_config
from scheduler.model.reference import LlamaModel, ModelConfig, ReferenceModel
from scheduler.service.config import ServeConfig
from tests.service_harness import Process, Server, free_port, idle, model_flags, wait_for
from tests.test_dp_metrics import check_replica_families, replica_totals, scraped

MODEL = ModelConfig(hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, intermediate=48,
                    max_position=256, seed=9)
#: ``/server_info``'s parallel layout.
LAYOUT = ("tp_size", "pp_size", "dp_size", "rank_processes")
PROMPTS = [[(7 * i + 3 * j + 1) % 250 for j in range(2 + 9 * i)] for i in range(4)]


@pytest.mark.multiprocess
def test_a_dp2_pp2_prefill_answers_as_the_colocated_model(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    server = Server(tmp_path / "serve.log", "--role", "prefill", "--backend", "fake",
                    *model_flags(MODEL), "--page-size", "4", "--chunked-prefill-size", "8",
                    "--dp-size", "2", "--pp-size", "2", "--log-level", "info",
                    env={"TMPDIR": str(temp)})
    try:
        server.wait_healthy(timeout=180)
        server.answers_as_colocated(MODEL, PROMPTS)
        info = server.get("/server_info")
        assert [info[k] for k in LAYOUT] == [1, 2, 2, 4], info
        # The ranks met through store files of their own, and listen on loopback only (no
        # rendezvous store on every interface; the fake backend opens no transfer engine).
        (stores,) = temp.glob("pdlife-ranks-*")
        assert {"replica0", "replica1"} <= {p.name for p in stores.iterdir()}
        pids = [server.proc.pid, *_rank_processes(server.proc.pid)]
        assert len(pids) == 4
        hosts = {lst.host for pid in pids for lst in listening(pid)}
        assert hosts == {"127.0.0.1"}, hosts
        # Both replicas' figures, each its own: two requests each, their prompts' whole pages
        # in their prefix caches.
        pages = sum(len(p) // 4 for p in PROMPTS)

        def metrics() -> dict[str, Any]:
            r = httpx.get(f"{server.url}/metrics", timeout=60)
            assert r.status_code == 200, r.text
            return scraped(r.text)

        families = metrics()
        check_replica_families(families, 2)
        done = ("pdlife_requests_finished_total", {"state": "done"})
        assert replica_totals(families, done[0], **done[1]) == {"0": 2, "1": 2}
        assert replica_totals(families, "pdlife_dp_replica_up") == {"0": 1, "1": 1}
        info = server.get("/server_info")
        pools = info["kv_pool"]
        assert set(pools) == set(info["requests"]) == {"prefill", "prefill/dp0", "prefill/dp1"}
        assert [pools[k]["total_pages"] for k in pools] == [2 * info["pool_pages"],
                                                            info["pool_pages"],
                                                            info["pool_pages"]], pools
        cached = [pools[k]["prefix_cache_pages"] for k in ("prefill/dp0", "prefill/dp1")]
        assert pools["prefill"]["prefix_cache_pages"] == sum(cached) == pages and all(cached)
        # The rank processes stopped (replica 0's second rank too: the idle server runs no
        # collective meanwhile): both answer within their wait, with replica 1's last figures.
        ranks = _rank_processes(server.proc.pid)
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            families = metrics()
            assert time.monotonic() - began < 30
            assert replica_totals(families, "pdlife_dp_replica_up") == {"0": 1, "1": 0}
            assert replica_totals(families, done[0], **done[1]) == {"0": 2, "1": 2}
            assert server.get("/server_info")["kv_pool"] == pools
        finally:
            for pid in ranks:
                os.kill(pid, signal.SIGCONT)
        wait_for(lambda: replica_totals(metrics(), "pdlife_dp_replica_up") == {"0": 1, "1": 1},
                 60, "replica 1 answering scrapes again")
        # /flush_cache empties every replica's cache (each prompt's whole pages), on every
        # rank of its mesh alike: the meshes answer as before after it.
        r = httpx.post(f"{server.url}/flush_cache", timeout=60)
        assert (r.status_code, r.text) == (200, f"Cache flushed: {pages} pages back in the KV "
                                                "pool.\n")
        server.answers_as_colocated(MODEL, PROMPTS)
        log = server.tail()
        assert server.stop(timeout=60) == 0, log
    finally:
        server.stop()
    assert not list(temp.glob("pdlife-ranks-*"))  # removed on the way out
    log = server.log.read_text()
    assert "DP 2 x TP 1 x PP 2, rank processes beside this one: 3" in log
    assert "killing them" not in log and "a prefill rank failed" not in log, log
    assert "leaked semaphore" not in log, log  # the replicas' queues are let go


def _rank_processes(parent: int) -> list[int]:
    """The pids of the rank processes ``parent`` spawned (not multiprocessing's tracker)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == parent and b"spawn_main" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.mooncake
@pytest.mark.multiprocess
def test_an_idle_server_whose_rank_dies_turns_unhealthy_and_exits_1(tmp_path: Path) -> None:
    """Nothing is asked of the server: rank 0 runs no collective that would fail, yet the
    rank's exit makes it unhealthy at once (the engine loop fails) and it exits 1. Its
    bootstrap endpoint's health turns 503 too, so a decode peer that sent a destination to the
    dead rank (which will never answer for it) counts the prefill lost and lets the room's
    pages go at its release bound."""
    bootstrap = free_port()
    flags = ["--backend", "mooncake", *model_flags(MODEL), "--log-level", "info"]
    server = Server(tmp_path / "serve.log", "--role", "prefill", "--bootstrap-port",
                    str(bootstrap), "--tp-size", "2", *flags)
    # A short release bound: the test waits it out (the default is 30 s).
    decode = Server(tmp_path / "decode.log", "--role", "decode",
                    "--lost-prefill-release-timeout", "3", *flags)
    try:
        server.wait_healthy(timeout=180)
        decode.wait_healthy(timeout=180)
        peers_health = f"http://127.0.0.1:{bootstrap}/health"
        assert httpx.get(peers_health, timeout=10).status_code == 200
        (rank,) = _rank_processes(server.proc.pid)
        os.kill(rank, signal.SIGKILL)
        wait_for(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 503, 20,
                 "/health turning 503")
        wait_for(lambda: httpx.get(peers_health, timeout=10).status_code == 503, 20,
                 "the bootstrap endpoint's /health turning 503")
        assert "engine failed" in httpx.get(peers_health, timeout=10).text
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
                "bootstrap_room": 222}
        with ThreadPoolExecutor(1) as pool:
            # The decode half first: its destination goes to both ranks, the dead one too.
            on_decode = pool.submit(httpx.post, f"{decode.url}/generate", timeout=60, json=body)
            wait_for(lambda: decode.get("/server_info")["requests"]["decode"]["receiving"] == 1,
                     60, "the decode half's destination sent")
            refused = httpx.post(f"{server.url}/generate", timeout=60, json=body)
            assert refused.status_code == 503, refused.text
            # Refused by the live rank; the dead one never says it stopped writing.
            failed = on_decode.result(60)
        assert failed.status_code == 503, failed.text
        assert failed.json()["error"]["type"] == refused.json()["error"]["type"]
        # The dead rank never sends the room's Status, and the failed server does not say that
        # its ranks stopped writing (the live one may still write): decode counts it lost after
        # two failed health checks and lets the room go at its release bound.
        wait_for(lambda: idle(decode.get("/server_info")), 90, "the decode's pages free")
        assert "lost contact with prefill" in decode.tail(100_000)
        server.signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 1, server.tail()
        assert f"a prefill rank process (pid {rank}) exited with code -9" in server.tail()
        assert "exiting 1: the engine loop failed: a prefill rank process" in server.tail()
    finally:
        decode.stop()
        server.stop()


@pytest.mark.multiprocess
def test_dp_replicas_of_a_real_checkpoint_answer_as_one(tmp_path: Path,
                                                        smollm2: Any) -> None:
    """Each replica's process loads the checkpoint again (it does not cross as an object)."""
    server = Server(tmp_path / "serve.log", "--role", "prefill", "--backend", "fake",
                    "--model", "smollm2", "--page-size", "4", "--dp-size", "2")
    try:
        server.wait_healthy(timeout=180)
        server.answers_as_colocated(smollm2, PROMPTS)
        assert [server.get("/server_info")[k] for k in LAYOUT] == [1, 1, 2, 2]
        log = server.tail()
        assert server.stop(timeout=60) == 0, log
    finally:
        server.stop()


@pytest.mark.mooncake
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("model", "prefill_flags", "decode_flags"),
    [("reference", ("--tp-size", "2", "--dp-size", "2"), ()),
     # A real checkpoint's TP shards on both sides (SmolLM2: 9 heads, 3 KV heads); the decode
     # ranks decode in lockstep, as the reference model's do.
     ("smollm2", ("--tp-size", "3"), ("--tp-size", "3"))],
    ids=["dp2-tp2-prefill-tp1-decode", "smollm2-tp3-tp3"],
)
def test_the_router_drives_a_prefill_and_a_decode_of_other_layouts(
    tmp_path: Path, request: pytest.FixtureRequest, model: str,
    prefill_flags: tuple[str, ...], decode_flags: tuple[str, ...]
) -> None:
    bootstrap = free_port()
    flags = model_flags(MODEL) if model == "reference" else ["--model", model]
    common = ["--backend", "mooncake", "--page-size", "4", "--chunked-prefill-size", "8",
              *flags, "--log-level", "warning"]
    procs: list[Process] = []
    try:
        prefill = Server(tmp_path / "prefill.log", "--role", "prefill", *prefill_flags,
                         "--bootstrap-port", str(bootstrap), *common)
        procs.append(prefill)
        decode = Server(tmp_path / "decode.log", "--role", "decode", *decode_flags, *common)
        procs.append(decode)
        prefill.wait_healthy(timeout=180)
        decode.wait_healthy(timeout=180)
        url = f"http://127.0.0.1:{free_port()}"
        router = Process([
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill.url, str(bootstrap), "--decode", decode.url,
            "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1],
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--policy", "round_robin", "--worker-startup-check-interval", "1",
            "--disable-retries", "--disable-circuit-breaker", "--log-level", "warn",
        ], tmp_path / "router.log")
        procs.append(router)

        def generate(prompt: list[int], n: int) -> httpx.Response:
            return httpx.post(f"{url}/generate", timeout=60, json={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": n,
                                                         "ignore_eos": True}})

        def routes() -> bool:
            router.check_alive("sglang router")
            try:
                return generate([1, 2], 1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(routes, 90, "router serving /generate")
        colocated: Any = (ReferenceModel(LlamaModel(MODEL)) if model == "reference"
                          else request.getfixturevalue(model))  # one rank, float32
        for prompt in PROMPTS:
            r = generate(prompt, 5)
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == colocated.generate(prompt, 5, ignore_eos=True)
        # The decode's own warm-up path (the fake prefill host) runs on every rank too.
        r = httpx.get(f"{decode.url}/health_generate", timeout=60)
        assert r.status_code == 200, r.text
        wait_for(lambda: idle(prefill.get("/server_info")) and idle(decode.get("/server_info")),
                 30, "both pools free again")
        for server, layout in ((prefill, prefill_flags), (decode, decode_flags)):
            tp, dp = (int(layout[layout.index(f) + 1]) if f in layout else 1
                      for f in ("--tp-size", "--dp-size"))
            info = server.get("/server_info")
            assert [info[k] for k in LAYOUT] == [tp, 1, dp, tp * dp], info
        router.stop(timeout=60)
        log = decode.tail()
        assert decode.stop(timeout=60) == 0, log  # its rank processes stopped by rank 0
        assert prefill.stop(timeout=60) == 0, prefill.tail()
    finally:
        for proc in reversed(procs):
            proc.stop(timeout=60)
    assert "killing them" not in decode.log.read_text()
    assert "leaked semaphore" not in prefill.log.read_text()


@pytest.mark.mooncake
@pytest.mark.multiprocess
def test_a_decode_refusal_reaches_the_replica_of_its_room(tmp_path: Path) -> None:
    """A prefill of two DP replicas and no decode: each refused room fails its request on the
    replica that serves it (``room % 2``) at once, whether the refusal comes before the
    request or after it; the bootstrap timeout is far beyond the test's."""
    bootstrap = free_port()
    server = Server(tmp_path / "prefill.log", "--role", "prefill", "--backend", "mooncake",
                    "--bootstrap-port", str(bootstrap), "--dp-size", "2", "--page-size", "4",
                    "--bootstrap-timeout", "3600", *model_flags(MODEL), "--log-level", "info")

    def refuse(room: int) -> None:
        r = httpx.post(f"http://127.0.0.1:{bootstrap}/refusal", timeout=30,
                       json={"room": room, "reason": f"decode gave up on {room}"})
        assert r.status_code == 200, r.text

    def waiting(info: dict[str, Any]) -> bool:
        requests = info["requests"]
        return bool(info["live_requests"] == 2
                    and requests["prefill/dp0"].get("bootstrapping") == 1
                    and requests["prefill/dp1"].get("bootstrapping") == 1)

    def generate(room: int) -> httpx.Response:
        return httpx.post(f"{server.url}/generate", timeout=120, json={
            "input_ids": PROMPTS[1], "sampling_params": {"max_new_tokens": 1},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap,
            "bootstrap_room": room})

    try:
        server.wait_healthy(timeout=180)
        answers: dict[int, httpx.Response] = {}
        for room in (11, 12):  # replica 1, then replica 0: the refusal first
            refuse(room)
            answers[room] = generate(room)
        with ThreadPoolExecutor(2) as pool:  # the requests first
            later = {room: pool.submit(generate, room) for room in (13, 14)}
            wait_for(lambda: waiting(server.get("/server_info")), 60,
                     "both requests live, each replica's waiting for its destination")
            for room in later:
                refuse(room)
            answers |= {room: f.result() for room, f in later.items()}
        for room, r in answers.items():
            assert r.status_code != 200, (room, r.text)
            assert f"decode gave up on {room}" in r.text, (room, r.text)
        wait_for(lambda: idle(server.get("/server_info")), 30, "the pool free again")
        log = server.tail()
        assert server.stop(timeout=60) == 0, log
    finally:
        server.stop()


def _config(*flags: str) -> ServeConfig:
    parser = argparse.ArgumentParser()
    SERVE.add_arguments(parser)
    return serve_config(parser.parse_args(flags))


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (("--role", "decode", "--backend", "fake", "--tp-size", "2"),
         "with backend 'fake': a decode server runs on several ranks only over the mooncake "
         r"backend \(--backend mooncake\)"),
        (("--role", "decode", "--backend", "mooncake", "--pp-size", "2"),
         r"a decode server runs on several ranks only as TP \(--tp-size N\); --pp-size and "
         "--dp-size are the prefill role's"),
        (("--backend", "local", "--pp-size", "2"),
         "only the prefill and decode roles run on several ranks"),
        (("--role", "decode", "--backend", "mooncake", "--tp-size", "3"),
         r"the model's heads \(4\) must be a multiple of TP 3"),
        (("--role", "prefill", "--backend", "fake", "--tp-size", "3"),
         r"the model's heads \(4\) must be a multiple of TP 3 \(--tp-size 1, 2, 4 fit the "
         r"model; its --heads, --kv-heads and --intermediate decide\)"),
        (("--role", "prefill", "--backend", "fake", "--pp-size", "3"),
         r"--pp-size must be in 1\.\.2, a stage for each of the model's --layers at most, "
         "got 3"),
        (("--role", "prefill", "--backend", "fake", "--model", "smollm2", "--pp-size", "2"),
         "a real checkpoint runs on TP ranks and DP replicas, not on pipeline stages"),
        (("--role", "decode", "--backend", "mooncake", "--model", "smollm2", "--tp-size", "2"),
         r"the checkpoint's heads \(9\) must be a multiple of TP 2"),
        (("--role", "decode", "--backend", "mooncake", "--overlap", "--schedule-policy",
          "lpm"),
         r"^--overlap and --schedule-policy: the prefill role's; a decode server has no "
         "prefill loop"),
        (("--role", "prefill", "--backend", "mooncake", "--allow-prefill", "10.0.0.5:8998"),
         "--allow-prefill names the prefill servers a decode worker may send its peer token "
         "to; this is not a decode worker: drop it"),
        # ModelConfig's own check, its fields named as the flags that set them.
        (("--role", "decode", "--backend", "mooncake", "--kv-heads", "3", "--tp-size", "2"),
         r"^--heads \(4\) must be a multiple of --kv-heads \(3\)$"),
        (("--role", "prefill", "--backend", "fake", "--heads", "600", "--head-dim", "128"),
         r"^--heads \* --head-dim must be at most 65536, got 76800$"),
    ],
)
def test_layouts_that_cannot_be_served_are_refused(flags: tuple[str, ...], problem: str) -> None:
    with pytest.raises(UsageError, match=problem):
        _config(*flags)


def test_model_config_keeps_its_field_names_for_library_users() -> None:
    with pytest.raises(ValueError, match=r"^ModelConfig\.heads \(4\) must be a multiple of kv"):
        ModelConfig(kv_heads=3)


def test_rank_counts_are_positive() -> None:
    with pytest.raises(SystemExit):
        _config("--role", "prefill", "--backend", "fake", "--tp-size", "0")
    config = _config("--role", "prefill", "--backend", "fake", "--tp-size", "2", "--pp-size", "2")
    assert (config.tp_size, config.pp_size, config.dp_size) == (2, 2, 1)
