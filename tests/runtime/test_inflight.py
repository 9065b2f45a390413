"""In-flight batching: a KV cache of rows at different positions (runtime/inflight.RowCacheDecoder)
and the scheduler that runs concurrent generations on it (serving/inflight.InflightScheduler).

The references are independent of both: transformers' own model of the same checkpoint (its
logits over each whole sequence, its greedy `generate`), and for seeded sampling the request
generated alone by OrtDecoder.generate, which runs no scheduler and no row cache."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from moedeploy.export.exporter import export
from moedeploy.models.generation import SamplingConfig
from moedeploy.runtime.generation import OrtDecoder
from moedeploy.runtime.gqa import ragged_indices
from moedeploy.runtime.inflight import RowCacheDecoder
from moedeploy.runtime.lowering import LoweringError
from moedeploy.serving.batching import ServerError, Unavailable
from moedeploy.serving.inflight import Finished, InflightScheduler

from ..families.cases import _family_config, make_model, save_checkpoint


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    config = _family_config("mixtral", 2, num_key_value_heads=2, head_dim=16, intermediate_size=30,
                            num_local_experts=4, num_experts_per_tok=2)
    hf = make_model(config, seed=4)
    root = tmp_path_factory.mktemp("inflight")
    return hf, export("decoder", root / "artifact", checkpoint=save_checkpoint(hf, root / "checkpoint"))


def _ids(vocab: int, length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, length)


@torch.no_grad()
def test_rows_at_different_positions_decode_together_as_transformers_computes_each(exported) -> None:
    """Three prompts of 5, 9 and 3 tokens prefilled into rows 0-2 one at a time, then decoded
    in steps of all rows at once, each at its own position; after row 0 ends, row 2 moves into
    its place and the two go on. Every row's logits are transformers' for its whole sequence."""
    hf, artifact = exported
    vocab = hf.config.vocab_size
    decoder = RowCacheDecoder(artifact, slots=4, capacity=32)
    sequences = [list(_ids(vocab, n, seed)) for n, seed in ((5, 1), (9, 2), (3, 3))]
    got: list[list[np.ndarray]] = [[] for _ in sequences]
    for row, ids in enumerate(sequences):
        got[row].append(decoder.prefill(row, np.array([ids]))[0])
    rows = [0, 1, 2]  # which sequence each cache row holds
    for step in range(6):
        if step == 3:  # sequence 0 ends: the last row fills its place
            decoder.move(2, 0, len(sequences[2]))
            rows = [2, 1]
        tokens = [int(got[s][-1].argmax()) for s in rows]
        lengths = [len(sequences[s]) for s in rows]
        for s, token in zip(rows, tokens, strict=True):
            sequences[s].append(token)
        logits = decoder.decode(0, np.array(tokens), np.array(lengths))
        for s, row_logits in zip(rows, logits, strict=True):
            got[s].append(row_logits)
    for s, ids in enumerate(sequences):
        expected = hf(torch.tensor([ids])).logits[0]  # (len, V): the logits after each position
        n = len(got[s])
        assert expected.abs().max() > 0.5
        torch.testing.assert_close(torch.from_numpy(np.stack(got[s])), expected[-n:], atol=1e-4, rtol=0)


@torch.no_grad()
def test_prompts_join_rows_that_decode_in_one_ragged_step_as_transformers_computes_each(exported) -> None:
    """One step where rows 0-1 decode a token each, at their own positions, while prompts of
    7 and 4 tokens join in rows 2-3 (so the step's chunks are 1, 1, 7 and 4 tokens, padded to
    7 for attention); then steps of all four decoding, then one where row 0 brings 2 tokens
    beside single ones. Every row's logits are transformers' at its last position."""
    hf, artifact = exported
    vocab = hf.config.vocab_size
    decoder = RowCacheDecoder(artifact, slots=4, capacity=24)
    sequences = [list(_ids(vocab, n, seed)) for n, seed in ((5, 11), (3, 12), (7, 13), (4, 14))]
    got: list[dict[int, np.ndarray]] = [{} for _ in sequences]  # position -> logits after it
    for row in (0, 1):
        got[row][len(sequences[row]) - 1] = decoder.prefill(row, np.array([sequences[row]]))[0]
        sequences[row].append(int(got[row][len(sequences[row]) - 1].argmax()))
    lengths = [len(sequences[0]) - 1, len(sequences[1]) - 1, 0, 0]  # what each row's cache holds
    for step in range(4):
        if step == 3:  # row 0 brings two tokens: the chosen one and one more
            sequences[0].append(int(_ids(vocab, 1, 15)[0]))
        chunks = [np.array(ids[length:]) for ids, length in zip(sequences, lengths, strict=True)]
        if step == 0:
            assert [len(c) for c in chunks] == [1, 1, 7, 4]
        for row, logits in enumerate(decoder.step(0, chunks, np.array(lengths))):
            got[row][len(sequences[row]) - 1] = logits
            sequences[row].append(int(logits.argmax()))
        lengths = [len(ids) - 1 for ids in sequences]
    for s, ids in enumerate(sequences):
        expected = hf(torch.tensor([ids[:-1]])).logits[0]  # the last token chosen is not fed
        assert expected.abs().max() > 0.5
        positions = sorted(got[s])
        assert len(positions) == (5 if s < 2 else 4)
        torch.testing.assert_close(torch.from_numpy(np.stack([got[s][p] for p in positions])), expected[positions],
                                   atol=1e-4, rtol=0)


@torch.no_grad()
def test_a_long_prompt_joins_a_row_at_the_end_of_the_models_positions(exported) -> None:
    """capacity = max_positions: row 0 holds 90 of the model's 96 positions when a 40-token
    prompt joins, so row 0's padding sits past position 96 (the rotary tables cover the rows'
    room). Both rows' logits are transformers'."""
    hf, artifact = exported
    vocab, positions = hf.config.vocab_size, hf.config.max_position_embeddings
    decoder = RowCacheDecoder(artifact, slots=2)
    assert decoder.capacity == positions
    long, prompt = list(_ids(vocab, positions - 6, 71)), list(_ids(vocab, 40, 72))
    decoder.prefill(0, np.array([long[:-1]]))
    logits = decoder.step(0, [np.array(long[-1:]), np.array(prompt)], np.array([len(long) - 1, 0]))
    for ids, row in ((long, logits[0]), (prompt, logits[1])):
        torch.testing.assert_close(torch.from_numpy(row), hf(torch.tensor([ids])).logits[0, -1], atol=1e-4, rtol=0)


def test_a_ragged_step_refuses_chunks_that_do_not_fit(exported) -> None:
    _, artifact = exported
    decoder = RowCacheDecoder(artifact, slots=2, capacity=8)
    with pytest.raises(ValueError, match=r"9 positions exceed a row.s capacity of 8"):
        decoder.step(0, [np.arange(3), np.arange(2)], np.array([2, 7]))
    with pytest.raises(ValueError, match="at least one token"):
        decoder.step(0, [np.arange(3), np.arange(0)], np.array([0, 0]))


def test_ragged_indices_map_packed_tokens_to_padded_chunks_and_back() -> None:
    """Rows of 2, 1 and 3 tokens: T = 6 packed tokens, chunks padded to 3."""
    padded, slots = ragged_indices(np.array([2, 1, 3]))
    valid = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(np.where(valid, padded, -1), [[0, 1, -1], [2, -1, -1], [3, 4, 5]])
    np.testing.assert_array_equal(slots[0], [[0, 0], [0, 1], [1, 0], [2, 0], [2, 1], [2, 2]])
    tokens = np.array([10, 11, 20, 30, 31, 32])
    assert [tokens[padded[r, s]] for r, s in slots[0]] == list(tokens)  # there and back


def test_a_row_cache_refuses_attention_groupqueryattention_cannot_take(tmp_path) -> None:
    from moedeploy.compare.api import compare

    config = _family_config("mixtral", 1, num_key_value_heads=2, head_dim=12, intermediate_size=30,
                            num_local_experts=4, num_experts_per_tok=2, hidden_size=48)  # head_dim not a multiple of 16
    artifact = export("decoder", tmp_path / "a", checkpoint=save_checkpoint(make_model(config, seed=1), tmp_path / "c"))
    with pytest.raises(LoweringError):
        RowCacheDecoder(artifact, slots=2)
    inflight = compare(artifact, ["ort-inflight"], iterations=1)["inflight"]  # compare says why it did not run
    assert inflight["passed"] and "head_dim 12 is not a multiple of 16" in inflight["skipped"]


def test_compare_checks_in_flight_batching_against_eager_and_can_fail(exported, tmp_path) -> None:
    """compare --backend ort-inflight: rows joining (the longer prompts in chunks of 4 beside
    decoding rows), leaving and moving, against eager PyTorch per sequence at every position
    a step gave logits for; the same check against the eager model of other weights fails."""
    from moedeploy.compare.api import compare, eager_reference
    from moedeploy.compare.inflight import inflight_accuracy

    _, artifact = exported
    report = compare(artifact, ["ort-inflight"], iterations=1)
    inflight = report["inflight"]
    assert report["passed"] and inflight["passed"] and inflight["skipped"] is None
    # prompts of 3, 7, 5, 11: the first alone and whole, the others in chunks of 4 beside it
    assert inflight["most_rows_in_a_step"] == 4 and inflight["positions"] == 4 * 7 + 4  # 7, 5, 11: 1 + 1 + 2 chunks
    assert inflight["prompt_chunks_before_the_last"] == 4
    assert inflight["steps_with_a_prompt_beside_decoding_rows"] == 5  # steps 1-5 (11 takes three)
    assert "4 prompt chunks fed before their prompt's last" in (artifact.path / "report" / "report.md").read_text()
    assert inflight["max_abs_error"] < 1e-4 and inflight["within_tolerance"] == 1.0
    assert "In-flight batching (ort-inflight): pass" in (artifact.path / "report" / "report.md").read_text()
    hf_other = make_model(exported[0].config, seed=5)  # the same shape, other weights
    other = export("decoder", tmp_path / "other", checkpoint=save_checkpoint(hf_other, tmp_path / "other-checkpoint"))
    broken = inflight_accuracy(artifact, eager_reference(other), atol=1e-4, rtol=1e-4)
    assert not broken["passed"] and broken["max_abs_error"] > 1e-2


@pytest.fixture(scope="module")
def scheduler(exported):
    _, artifact = exported
    scheduler = InflightScheduler(RowCacheDecoder(artifact, slots=3, capacity=64), max_queued=16)
    yield scheduler
    scheduler.stop()


SEVEN_REQUESTS = [(4, 12), (9, 3), (4, 20), (2, 1), (13, 9), (6, 15), (4, 6)]  # (prompt tokens, new tokens)


def _concurrent_greedy(hf, scheduler: InflightScheduler, first_decodes: bool = False) -> None:
    """Seven requests of different lengths and budgets from seven threads, started a few ms
    apart, on three rows: each gets the tokens transformers' greedy generate gives it alone.
    first_decodes: the first (48 new tokens) decodes alone, the second (9 tokens) joins it at
    the step after its first token, and the other five clients' threads start at the step
    after that (each then waits its 3 ms a place); the scheduler's own thread starts them (`_events(then=...)`), so no slow test thread can
    let the first finish before the second joins."""
    vocab = hf.config.vocab_size
    budgets = [(4, 48), *SEVEN_REQUESTS[1:]] if first_decodes else SEVEN_REQUESTS
    requests = [(_ids(vocab, n, seed), new) for seed, (n, new) in enumerate(budgets)]
    expected = [hf.generate(torch.from_numpy(p)[None], max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, len(p):].tolist()
                for p, new in requests]
    got: list[list[int]] = [[] for _ in requests]

    def client(i: int) -> None:
        time.sleep(0.003 * i)
        for token in scheduler.stream(requests[i][0], requests[i][1], SamplingConfig()):
            got[i].append(token)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    if not first_decodes:
        for t in threads:
            t.start()
    else:
        started = []  # the first is submitted here, its tokens read from its events
        queued_in_time: list[bool] = []

        def start_the_others(_: list) -> None:  # between two steps, on the scheduler's thread
            if not started:  # the first decodes: the second is queued before the next step
                started.append(threads[1])
                threads[1].start()
                deadline = time.monotonic() + 30
                while scheduler.queued == 0 and time.monotonic() < deadline:
                    time.sleep(0.0005)
                queued_in_time.append(scheduler.queued > 0)
            elif len(started) == 1:  # the second joined at the step that just ran: the rest may come
                started.extend(threads[2:])
                for t in threads[2:]:
                    t.start()

        events, done = _events(scheduler, *requests[0], then=start_the_others)
        assert done.wait(60)
        got[0] = [e for e in events if isinstance(e, int)]
        assert events[-1] == Finished("length") and queued_in_time == [True]
    for t in threads[1:] if first_decodes else threads:
        t.join(60)
    assert got == expected
    assert scheduler.running == 0 and scheduler.queued == 0


@torch.no_grad()
def test_concurrent_greedy_generations_are_each_transformers_alone(exported, scheduler) -> None:
    """They join and leave between steps, some wait for a row and are prefilled in the step
    that decodes the others (every prompt here fits one chunk)."""
    hf, _ = exported
    mixed_before = scheduler.mixed_steps
    _concurrent_greedy(hf, scheduler)
    assert scheduler.mixed_steps > mixed_before  # prompts did join beside decoding rows
    assert scheduler.partial_chunks == 0


@torch.no_grad()
def test_prompts_fed_in_chunks_beside_decoding_rows_give_the_same_tokens(exported) -> None:
    """prefill_chunk=3: a prompt that joins while rows decode goes into its row 3 tokens a
    step (its rows at a past length the ragged step must honour), and its first token comes
    after its last chunk; the tokens are still transformers' for each request alone."""
    hf, artifact = exported
    scheduler = InflightScheduler(RowCacheDecoder(artifact, slots=3, capacity=64), max_queued=16, prefill_chunk=3)
    try:
        _concurrent_greedy(hf, scheduler, first_decodes=True)  # the second (9 tokens) joins a decoding row
    finally:
        scheduler.stop()
    assert scheduler.partial_chunks > 0 and scheduler.mixed_steps > 0


def test_a_negative_prefill_chunk_and_an_empty_prompt_are_refused(exported) -> None:
    _, artifact = exported
    with pytest.raises(ValueError, match=r"prefill_chunk must be >= 0"):
        InflightScheduler(RowCacheDecoder(artifact, slots=1, capacity=16), prefill_chunk=-1)
    scheduler = InflightScheduler(RowCacheDecoder(artifact, slots=1, capacity=16))
    try:
        with pytest.raises(ValueError, match="a prompt needs at least one token"):
            scheduler.submit(np.array([], dtype=np.int64), 2, SamplingConfig(), lambda e: None)
    finally:
        scheduler.stop()


@torch.no_grad()
def test_prompts_prefilled_in_their_own_step_give_the_same_tokens(exported) -> None:
    """prompts_in_step=False (what benchmarks compare against): the same greedy tokens, and no
    step mixes a prompt with decoding rows."""
    hf, artifact = exported
    vocab = hf.config.vocab_size
    scheduler = InflightScheduler(RowCacheDecoder(artifact, slots=2, capacity=64), prompts_in_step=False)
    requests = [(_ids(vocab, n, 60 + n), new) for n, new in ((3, 8), (6, 4), (5, 6))]
    got: list[list[int] | None] = [None] * len(requests)

    def client(i: int) -> None:
        time.sleep(0.003 * i)
        got[i] = list(scheduler.stream(requests[i][0], requests[i][1], SamplingConfig()))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        scheduler.stop()
    expected = [hf.generate(torch.from_numpy(p)[None], max_new_tokens=new, min_new_tokens=new, do_sample=False)[0, len(p):].tolist()
                for p, new in requests]
    assert got == expected and scheduler.mixed_steps == 0


def test_a_seeded_sampled_generation_is_the_same_beside_others(exported, scheduler) -> None:
    hf, artifact = exported
    vocab = hf.config.vocab_size
    prompt = _ids(vocab, 7, 11)
    alone = OrtDecoder(artifact).generate(prompt, max_new_tokens=16, temperature=0.9, top_k=20, seed=5)[7:].tolist()
    sampling = SamplingConfig(0.9, 20, None, 5)
    results: dict[int, list[int]] = {}

    def client(i: int) -> None:
        results[i] = list(scheduler.stream(prompt if i == 0 else _ids(vocab, 3 + i, i), 16,
                                           sampling if i == 0 else SamplingConfig(1.0, None, 0.9, i)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[0] == alone
    assert len(set(alone)) > 3  # really sampled, not one token repeated


def _events(scheduler: InflightScheduler, prompt, new, then: Callable[[list], None] | None = None,
            **kw) -> tuple[list, threading.Event]:
    """Submit one generation; its events collect in the list, the Event is set by its last.
    `then(events)` runs on the scheduler's thread after each event, between two steps: what it
    submits joins, and what it cancels ends, at the next step, however slowly the test's own
    thread is scheduled."""
    events: list = []
    done = threading.Event()

    def on_event(event) -> None:
        events.append(event)
        if then is not None:
            then(events)
        if not isinstance(event, int):
            done.set()

    scheduler.submit(prompt, new, SamplingConfig(), on_event, **kw)
    return events, done


@torch.no_grad()
def test_generation_stops_at_an_eos_id_and_says_why(exported, scheduler) -> None:
    hf, _ = exported
    prompt = _ids(hf.config.vocab_size, 5, 21)
    greedy = hf.generate(torch.from_numpy(prompt)[None], max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, 5:].tolist()
    eos = greedy[3]
    events, done = _events(scheduler, prompt, 10, eos=frozenset({eos}))
    assert done.wait(30)
    stop = greedy.index(eos) + 1
    assert events == [*greedy[:stop], Finished("stop")]
    events, done = _events(scheduler, prompt, 4)
    assert done.wait(30)
    assert events == [*greedy[:4], Finished("length")]


def test_a_cancelled_generation_frees_its_row_and_the_others_go_on(exported, scheduler) -> None:
    hf, _ = exported
    vocab = hf.config.vocab_size
    flag = threading.Event()
    cancelled_events, cancelled_done = _events(scheduler, _ids(vocab, 4, 31), 50, cancelled=flag.is_set,
                                               then=lambda events: len(events) == 2 and flag.set())
    other = _ids(vocab, 6, 32)
    other_events, other_done = _events(scheduler, other, 30)
    assert cancelled_done.wait(30) and other_done.wait(30)
    assert cancelled_events[-1] == Finished("cancelled") and len(cancelled_events) == 3  # cancelled after two
    with torch.no_grad():
        expected = hf.generate(torch.from_numpy(other)[None], max_new_tokens=30, min_new_tokens=30, do_sample=False)[0, 6:]
    assert other_events == [*expected.tolist(), Finished("length")]
    assert scheduler.running == 0


def test_beyond_the_rows_and_the_queue_a_request_is_refused_busy(exported) -> None:
    hf, artifact = exported
    scheduler = InflightScheduler(RowCacheDecoder(artifact, slots=1, capacity=64), max_queued=1)
    try:
        vocab = hf.config.vocab_size
        stop = threading.Event()
        _events(scheduler, _ids(vocab, 3, 1), 60, cancelled=stop.is_set)
        second, second_done = _events(scheduler, _ids(vocab, 3, 2), 2)
        with pytest.raises(Unavailable, match=r"the server is busy: .* retry later"):
            scheduler.submit(_ids(vocab, 3, 3), 2, SamplingConfig(), lambda e: None)
        stop.set()
        assert second_done.wait(30) and second[-1] == Finished("length") and len(second) == 3
        with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(5\) exceeds the 64 positions a sequence may hold"):
            scheduler.submit(_ids(vocab, 60, 3), 5, SamplingConfig(), lambda e: None)
    finally:
        scheduler.stop()
    with pytest.raises(Unavailable, match="shutting down"):
        scheduler.submit(_ids(vocab, 3, 3), 2, SamplingConfig(), lambda e: None)


@torch.no_grad()
def test_a_prompt_that_fails_in_the_backend_fails_alone(exported, scheduler) -> None:
    """A token id outside the vocabulary (one that slipped past the request checks) makes ONNX
    Runtime's Gather fail; prefilled with two good prompts of its length, only it fails."""
    hf, _ = exported
    vocab = hf.config.vocab_size
    good = [_ids(vocab, 5, 41), _ids(vocab, 5, 42)]
    bad = np.array([1, 2, vocab + 7, 3, 4])
    runs = [_events(scheduler, p, 5) for p in (good[0], bad, good[1])]
    for _, done in runs:
        assert done.wait(30)
    assert isinstance(runs[1][0][-1], ServerError) and "generation failed" in str(runs[1][0][-1])
    for (events, _), prompt in zip((runs[0], runs[2]), good, strict=True):
        expected = hf.generate(torch.from_numpy(prompt)[None], max_new_tokens=5, min_new_tokens=5, do_sample=False)[0, 5:]
        assert events == [*expected.tolist(), Finished("length")]


@torch.no_grad()
def test_a_row_whose_sampling_fails_fails_alone_and_a_vanishing_temperature_decodes_greedily(
        exported, scheduler, monkeypatch) -> None:
    """Sampling runs row by row after the shared step: a row whose next_token raises (injected
    here for one sampling config) fails alone, its row freed, while the rows beside it get
    transformers' greedy tokens. A temperature of 1e-45 (valid in the OpenAI API; it made softmax
    NaN and failed every row of the batch) now samples the argmax: transformers' greedy tokens."""
    import moedeploy.serving.inflight as inflight

    hf, _ = exported
    vocab = hf.config.vocab_size
    doomed = SamplingConfig(temperature=0.123, seed=1)
    real = inflight.next_token

    def failing_for_doomed(logits, sampling, generator):
        if sampling is doomed:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, sampling, generator)

    monkeypatch.setattr(inflight, "next_token", failing_for_doomed)
    prompts = [_ids(vocab, 5, 61), _ids(vocab, 4, 62), _ids(vocab, 6, 63)]
    runs = []
    for prompt, sampling in zip(prompts, (SamplingConfig(), doomed, SamplingConfig(temperature=1e-45, seed=2)),
                                strict=True):
        events: list = []
        done = threading.Event()
        scheduler.submit(prompt, 12, sampling, lambda e, ev=events, d=done: (ev.append(e), isinstance(e, int) or d.set()))
        runs.append((events, done))
    for _, done in runs:
        assert done.wait(30)
    failed = runs[1][0]
    assert isinstance(failed[-1], ServerError) and "generation failed: probability tensor" in str(failed[-1])
    for i in (0, 2):
        expected = hf.generate(torch.from_numpy(prompts[i])[None], max_new_tokens=12, min_new_tokens=12,
                               do_sample=False)[0, prompts[i].size:]
        assert runs[i][0] == [*expected.tolist(), Finished("length")]
    assert scheduler.running == 0


@torch.no_grad()
def test_a_prompt_that_fails_in_a_later_chunk_fails_alone(exported) -> None:
    """With prefill_chunk=2, a prompt whose third id is outside the vocabulary joins two
    decoding rows beside another prompt: its first chunk runs, its second fails the step.
    Retried row by row, only it fails, its row is freed, and the decoding rows and the other
    prompt get transformers' tokens."""
    hf, artifact = exported
    vocab = hf.config.vocab_size
    scheduler = InflightScheduler(RowCacheDecoder(artifact, slots=4, capacity=64), prefill_chunk=2)
    try:
        prompts = [_ids(vocab, 4, 51), _ids(vocab, 3, 53), np.array([1, 2, vocab + 7, 3]), _ids(vocab, 5, 52)]
        budgets = [14, 14, 6, 6]
        second: list = []
        others: list = []

        def submit_the_second(_: list) -> None:  # the first decodes: the second joins it at the next step
            if not second:
                second.append(_events(scheduler, prompts[1], budgets[1], then=join_the_others))

        def join_the_others(events: list) -> None:  # the second's first token, the first still decoding
            if not others and events:
                others.extend(_events(scheduler, prompts[i], budgets[i]) for i in (2, 3))

        first = _events(scheduler, prompts[0], budgets[0], then=submit_the_second)
        assert first[1].wait(30)
        runs = [first, *second, *others]
        assert len(runs) == 4
        for _, done in runs:
            assert done.wait(30)
        assert scheduler.partial_chunks > 0
    finally:
        scheduler.stop()
    assert isinstance(runs[2][0][-1], ServerError) and "generation failed" in str(runs[2][0][-1])
    assert runs[2][0][:-1] == []  # no token before it failed
    for (events, _), prompt, new in ((runs[i], prompts[i], budgets[i]) for i in (0, 1, 3)):
        expected = hf.generate(torch.from_numpy(prompt)[None], max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert events == [*expected[0, prompt.size:].tolist(), Finished("length")]
    assert scheduler.running == 0 and scheduler.finished["failed"] == 1


@torch.no_grad()
def test_a_row_mid_prefill_moves_into_a_freed_row_and_goes_on(exported) -> None:
    """prefill_chunk=2: a 9-token prompt joins beside one decoding row, which is cancelled right
    after the prompt's first chunk. Its row 0 is freed, the prompt's row (mid-prefill, 2
    positions fed) moves into it, and the rest of the prompt (in one step: no row decodes any
    more) and its tokens follow from there: transformers' greedy tokens for that prompt alone."""
    hf, artifact = exported
    vocab = hf.config.vocab_size
    scheduler = InflightScheduler(RowCacheDecoder(artifact, slots=2, capacity=64), prefill_chunk=2)
    try:
        prompt = _ids(vocab, 9, 72)
        joined: list = []

        def join_the_prompt(_: list) -> None:  # it decodes before the prompt joins, so the prompt goes in chunks
            if not joined:
                joined.append(_events(scheduler, prompt, 6))

        first = _events(scheduler, _ids(vocab, 4, 71), 40, then=join_the_prompt,
                        cancelled=lambda: scheduler.partial_chunks >= 1)
        assert first[1].wait(30)
        (second,) = joined
        assert second[1].wait(30)
    finally:
        scheduler.stop()
    assert first[0][-1] == Finished("cancelled")
    expected = hf.generate(torch.from_numpy(prompt)[None], max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, 9:]
    assert second[0] == [*expected.tolist(), Finished("length")]
    assert scheduler.partial_chunks == 1 and scheduler.running == 0  # 9 tokens: 2, then 7 alone
