"""An LLM archived, loaded and generating: examples/llm.py's ``tiny`` config.

``jax.jit(generate)`` (prefill and a KV-cached greedy decode loop in one function) and
``jax.jit(sample)`` (the same with one PRNG key per row) are logged with
``mlflow.jaxexp.log_model`` into a real sqlite store with file artifacts; what comes back through
``load_model``, ``mlflow.pyfunc.load_model``, ``jaxexp verify`` (the console script) and ``mlflow
models serve`` must be the raw jitted call's tokens, exactly.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import jax
import mlflow
import numpy as np
import pytest
import requests

import jaxexp_mlflow  # noqa: F401  (mlflow.jaxexp)
from tests.conftest import llm_example
from tests.servers import server_env, start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
JAXEXP = Path(sys.executable).with_name("jaxexp")


def _example() -> object:
    return llm_example()


llm = _example()


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Both functions logged in one run of a sqlite store; the raw tokens beside them."""
    tmp = tmp_path_factory.mktemp("llm")
    env = server_env(tmp)
    cfg = llm.CONFIGS["tiny"]
    params = llm.init_params(cfg, jax.random.key(0))
    ids, keys = llm.prompt(cfg, batch=2), llm.keys(2, seed=1)
    mlflow.set_tracking_uri(env["MLFLOW_TRACKING_URI"])
    try:
        exp = mlflow.create_experiment("llm", artifact_location=(tmp / "artifacts").as_uri())
        with mlflow.start_run(experiment_id=exp) as run:
            greedy = mlflow.jaxexp.log_model(
                jax.jit(llm.generate), name="generate", params=params, input_example=ids
            )
            sampler = mlflow.jaxexp.log_model(
                jax.jit(llm.sample), name="sample", params=params, input_example=(ids, keys)
            )
        yield {
            "tmp": tmp,
            "env": env,
            "params": params,
            "cfg": cfg,
            "ids": ids,
            "keys": keys,
            "greedy": f"runs:/{run.info.run_id}/generate",
            "sampler": f"runs:/{run.info.run_id}/sample",
            "greedy_uri": greedy.model_uri,
            "sampler_uri": sampler.model_uri,
        }
    finally:
        mlflow.set_tracking_uri(None)


def test_the_example_is_the_model_the_issue_asks_for():
    """Gemma-like sizes read back from the params; the cached decode equals a full recompute."""
    cfg = llm.CONFIGS["tiny"]
    params = llm.init_params(cfg, jax.random.key(0))
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.n_params()
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(jax.numpy.bfloat16)}
    assert cfg.n_kv_heads < cfg.n_heads  # grouped-query attention
    assert 0.95e9 < llm.CONFIGS["1b"].n_params() < 1.1e9
    ids = llm.prompt(cfg, batch=2, length=5)
    tokens = np.asarray(jax.jit(llm.generate, static_argnums=2)(params, ids, 4))
    seq, forward = ids, jax.jit(llm.forward)
    for i in range(4):  # no cache: the whole sequence again for every token
        cache = jax.numpy.zeros((cfg.n_layers, 2, 2, seq.shape[1], cfg.n_kv_heads, cfg.head_dim))
        logits, _ = forward(params, seq, 0, cache.astype(params["embed"].dtype))
        nxt = np.asarray(logits.argmax(-1), np.int32)
        assert np.array_equal(nxt, tokens[:, i]), i
        seq = np.concatenate([seq, nxt[:, None]], axis=1)
    assert len(set(tokens.ravel().tolist())) > 2  # not one token repeated


def test_load_model_and_pyfunc_give_the_raw_tokens(logged):
    params, ids, keys = logged["params"], logged["ids"], logged["keys"]
    raw = jax.jit(llm.generate)
    model = mlflow.jaxexp.load_model(logged["greedy"])
    pyfunc = mlflow.pyfunc.load_model(logged["greedy_uri"])
    for batch in (2, 3):  # the batch dimension is symbolic; 3 is padded to 4 by pyfunc
        x = llm.prompt(logged["cfg"], batch=batch, seed=batch)
        want = np.asarray(raw(params, x))
        assert want.shape == (batch, 16) and want.dtype == np.int32
        assert np.array_equal(np.asarray(model(x)), want)
        assert np.array_equal(np.asarray(pyfunc.predict(x)), want)
    # sampling: one key per row, the same tokens as the raw call; another key, other tokens
    raw_sample = jax.jit(llm.sample)
    want = np.asarray(raw_sample(params, ids, keys))
    sampler = mlflow.jaxexp.load_model(logged["sampler"])
    assert np.array_equal(np.asarray(sampler(ids, keys)), want)
    assert not np.array_equal(np.asarray(sampler(ids, llm.keys(2, seed=7))), want)
    sampled = mlflow.pyfunc.load_model(logged["sampler_uri"])
    names = [s.name for s in sampled._model_impl.inputs]
    assert np.array_equal(
        np.asarray(sampled.predict(dict(zip(names, (ids, keys), strict=True)))), want
    )


def test_jaxexp_verify_reproduces_the_stored_reference(logged):
    """The console script in a fresh process: the stored reference tokens, reproduced."""
    env = {**logged["env"], "PATH": f"{JAXEXP.parent}:{logged['env']['PATH']}"}
    done = subprocess.run(
        [str(JAXEXP), "verify", logged["greedy"]],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Reproduced: all 1 output(s) match." in done.stdout


def test_a_server_compiles_one_bucket_of_a_loop_ahead_and_none_by_running_it(logged):
    """Inside a server, a generate loop gets its first bucket compiled in the background, not
    all eleven (minutes before a 100M model would answer); compiled, not run."""
    from jaxexp_mlflow.runtime import buckets
    from jaxexp_mlflow.serving.pyfunc import JaxExpPyfunc

    model = mlflow.jaxexp.load_model(logged["greedy"])
    assert buckets.has_loop(model.exported)
    assert not buckets.has_loop(jax.export.export(jax.jit(lambda x: x * 2))(np.ones(3)))
    plain = mlflow.pyfunc.load_model(logged["greedy_uri"])._model_impl
    impl = JaxExpPyfunc(
        model,
        {"compilation_cache": False},
        inputs=plain.inputs,
        outputs=plain.outputs,
        serving=True,
        rows_independent=True,
    )
    assert impl.policy.precompile == buckets.powers_of_two(1024)  # the serving default...
    impl._precompiling.join(timeout=300)
    assert impl._flat.compiles + impl._flat.loaded == 1  # ...but one bucket for a loop
    assert impl._flat._cache_size() == 1
    ids = logged["ids"][:1]
    want = np.asarray(jax.jit(llm.generate)(logged["params"], ids))
    assert np.array_equal(impl.predict(ids), want)  # its first call: the prepared executable
    assert impl._flat.compiles + impl._flat.loaded == 1


@pytest.mark.slow
def test_mlflow_models_serve_answers_a_prompt(logged):
    """The real ``mlflow models serve`` from the runs:/ URI: token ids in, token ids out."""
    tmp, ids = logged["tmp"], logged["ids"]
    want = np.asarray(jax.jit(llm.generate)(logged["params"], ids))
    start = time.perf_counter()
    proc, url = start_server(logged["greedy"], "local", logged["env"], tmp / "serve.log")
    try:
        print(f"mlflow models serve: /ping after {time.perf_counter() - start:.1f} s")
        reply = requests.post(f"{url}/invocations", json={"inputs": ids.tolist()}, timeout=300)
        assert reply.status_code == 200, reply.text[:500]
        assert np.array_equal(np.asarray(reply.json()["predictions"]), want)
        one = requests.post(f"{url}/invocations", json={"inputs": ids[:1].tolist()}, timeout=300)
        assert np.array_equal(np.asarray(one.json()["predictions"]), want[:1])
    finally:
        stop_server(proc)


def test_a_typed_key_input_is_refused_with_what_to_pass_instead(tmp_path):
    """A key array (``key<fry>[b]``) exports but no door can carry it: a typed error at save
    naming ``key_data``, and nothing left at the path."""
    from jaxexp_mlflow.errors import UnsupportedModelError

    cfg = llm.CONFIGS["tiny"]
    params = llm.init_params(cfg, jax.random.key(0))

    def sample_keys(params, prompt_ids, keys):
        return llm.sample(params, prompt_ids, jax.random.key_data(keys), max_new_tokens=2)

    keys = jax.random.split(jax.random.key(1), 2)
    with pytest.raises(UnsupportedModelError, match="key_data") as err:
        mlflow.jaxexp.save_model(
            jax.jit(sample_keys),
            tmp_path / "m",
            params=params,
            input_example=(llm.prompt(cfg), keys),
        )
    assert "'keys' is a key<fry> array" in str(err.value)
    assert not (tmp_path / "m").exists()
