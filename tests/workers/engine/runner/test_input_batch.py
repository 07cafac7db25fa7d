"""The persistent input batch on the host: rows kept from the scheduler's diffs, and each step's packed
buffer built from them (no device needed: the CPU tensors stand in for the device copies)."""

import numpy as np
import torch

from tests.workers.engine.sched.test_scheduler import make_request
from workers.engine.kv.block_manager import BlockManager
from workers.engine.request import Request
from workers.engine.runner.input_batch import InputBatch, PackedLayout
from workers.engine.runner.request_states import RequestStates
from workers.engine.sched.scheduler import Scheduler
from workers.protocol.sampling_params import SamplingParams

PAGE = 4


class Driver:
    """The scheduler, the runner's request states and an input batch, stepped as the engine does."""

    def __init__(self, max_batched_tokens: int = 100, windows: tuple[int | None, ...] = (None,)) -> None:
        self.scheduler = Scheduler(
            BlockManager(num_pages=64, page_size=PAGE, windows=windows),
            max_num_seqs=4,
            max_num_batched_tokens=max_batched_tokens,
        )
        self.states = RequestStates()
        self.batch = InputBatch(
            max_rows=4,
            max_pages=16,
            page_size=PAGE,
            vocab_size=512,
            device=torch.device("cpu"),
            seed=0,
            num_groups=len(windows),
        )
        self.requests: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def step(self, sampled: int = 9) -> dict[str, np.ndarray]:
        output = self.scheduler.schedule()
        dropped = self.states.update(output)
        self.batch.update(output, dropped)
        plan = self.batch.plan(output, self.states)
        layout, packed = self.batch.prepare(plan, output, self.states)
        self.scheduler.finish_step(output, self.requests)
        for request_id, sample in zip(output.request_ids, output.sample, strict=True):
            if sample:
                self.requests[request_id].output_token_ids.append(sampled)
        return fields(layout, packed)


def fields(layout: PackedLayout, packed: torch.Tensor) -> dict[str, np.ndarray]:
    values = packed.numpy()
    return {name: values[cut].copy() for name, cut in layout.slices.items()}


def test_a_decode_token_the_row_sampled_is_read_on_the_device_and_a_prompt_chunk_is_sent():
    driver = Driver(max_batched_tokens=6)
    driver.add(make_request("a", 3))
    driver.add(make_request("b", 7, start=100))

    first = driver.step()  # a's whole prompt (samples), b's first 3 prompt tokens
    second = driver.step()  # a decodes, b's remaining 4 prompt tokens (samples)
    third = driver.step()  # both decode

    assert list(first["input_ids"]) == [0, 1, 2, 100, 101, 102]
    assert list(second["input_ids"]) == [-1, 103, 104, 105, 106]
    assert list(third["input_ids"]) == [-1, -1]
    assert list(second["positions"]) == [3, 3, 4, 5, 6]


def test_logits_are_taken_only_for_the_sequences_that_sample():
    driver = Driver(max_batched_tokens=6)
    driver.add(make_request("a", 3))
    driver.add(make_request("b", 7, start=100))

    first = driver.step()

    assert list(first["logit_rows"]) == [2]  # a's last prompt token; b's chunk does not sample
    assert list(first["step"]) == [0]
    row_a = driver.batch.row_of["a"]
    assert list(first["sample_rows"]) == [row_a]
    second = driver.step()
    assert list(second["logit_rows"]) == [0, 4] and list(second["step"]) == [1, 0]


def test_block_tables_follow_the_pages_each_request_gains():
    driver = Driver()
    driver.add(make_request("a", 3))
    for _ in range(7):  # the prompt, then positions 3..8: a second and a third page
        driver.step()

    row = driver.batch.row_of["a"]
    pages = driver.requests["a"].pages
    assert len(pages) == 3
    assert list(driver.batch.tables_np[row, 0, :3]) == pages
    assert (driver.batch.tables_np[row, 0, 3:] == 0).all()


def test_a_dropped_row_is_reused_with_its_new_request_s_table():
    driver = Driver()
    driver.add(make_request("a", 9))
    driver.step()
    row = driver.batch.row_of["a"]
    driver.scheduler.remove(driver.requests.pop("a"))
    driver.add(make_request("b", 2, start=100))

    driver.step()

    assert "a" not in driver.batch.row_of and driver.batch.row_of["b"] == row
    assert list(driver.batch.tables_np[row, 0, :2]) == [driver.requests["b"].pages[0], 0]


def test_each_kv_group_has_its_block_table_and_slots():
    # A full-attention group and a window of 5 tokens, whose pages behind it go back to its pool.
    driver = Driver(max_batched_tokens=6, windows=(None, 5))
    driver.add(make_request("a", 6))
    manager = driver.scheduler.block_manager
    request = driver.requests["a"]
    first = driver.step()  # positions 0..5: two pages in each group
    first_window = list(manager.pages_of(request, 1))
    for _ in range(4):  # positions 6..9
        last = driver.step()

    full, window = request.pages, manager.pages_of(request, 1)
    slots = first["slot_mapping"].reshape(2, 6)
    assert list(slots[0]) == [full[p // PAGE] * PAGE + p % PAGE for p in range(6)]
    assert list(slots[1]) == [first_window[p // PAGE] * PAGE + p % PAGE for p in range(6)]
    # Position 9 reads 5..9: the window's first page (0..3) went back before the step computing it.
    assert window == [0, first_window[1], window[2]] and len(full) == 3
    assert list(last["slot_mapping"]) == [full[2] * PAGE + 1, window[2] * PAGE + 1]
    row = driver.batch.row_of["a"]
    # The runner's table keeps the released page's id (never read: it is behind the window).
    assert list(driver.batch.tables_np[row, 1, :3]) == first_window + [window[2]]
    assert list(driver.batch.tables_np[row, 0, :3]) == full


def test_sampling_settings_come_from_each_row():
    driver = Driver()
    driver.add(make_request("a", 2))
    seeded = make_request("b", 2, start=100)
    seeded.params = SamplingParams(temperature=0.5, top_k=7, top_p=0.9, min_p=0.1, seed=42)
    driver.add(seeded)

    first = driver.step()

    assert list(first["greedy"]) == [0, 0]  # make_request's default params sample at temperature 1
    assert list(first["top_k"]) == [0, 7]
    assert list(first["temperature"].view(np.float64)) == [1.0, 0.5]
    assert list(first["top_p"].view(np.float64)) == [1.0, 0.9]
    assert list(first["min_p"].view(np.float64)) == [0.0, 0.1]


def test_a_row_reused_by_a_request_without_extras_gets_a_neutral_bias_and_mask():
    driver = Driver()
    biased = make_request("biased", 3)
    biased.params = SamplingParams(temperature=0.0, logit_bias={5: 50.0}, presence_penalty=1.0)
    driver.add(biased)
    driver.add(make_request("penalised", 3, start=100))
    driver.requests["penalised"].params = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    driver.step()
    row = driver.batch.row_of["biased"]
    driver.batch.extras.allowed[row, :7] = False  # as a constrained request's last mask would leave it
    driver.scheduler.remove(driver.requests.pop("biased"))
    driver.add(make_request("plain", 3, start=200))

    driver.step()

    assert driver.batch.row_of["plain"] == row
    extras = driver.batch.extras
    assert not extras.bias[row].any() and extras.allowed[row].all()


def test_the_step_s_device_tensors_are_per_kv_group_sharing_all_but_slots_and_tables():
    driver = Driver(max_batched_tokens=6, windows=(None, 5))
    driver.add(make_request("a", 6))
    driver.add(make_request("b", 3, start=100))
    output = driver.scheduler.schedule()
    dropped = driver.states.update(output)
    driver.batch.update(output, dropped)
    plan = driver.batch.plan(output, driver.states)

    layout, packed = driver.batch.prepare(
        plan, output, driver.states, pad_to=PackedLayout(8, 8, 8, 2)
    )  # a CUDA graph's bucket
    full, window = driver.batch.step_inputs(layout, packed, decode_only=False, max_query_len=6).attention

    manager = driver.scheduler.block_manager
    a = driver.requests["a"]
    assert full.positions is window.positions and full.seq_lens is window.seq_lens
    assert list(full.block_tables[0, :2]) == a.pages and list(window.block_tables[0, :2]) == manager.pages_of(a, 1)
    assert window.slot_mapping[:6].tolist() == [manager.pages_of(a, 1)[p // PAGE] * PAGE + p % PAGE for p in range(6)]
    assert full.slot_mapping[6:].tolist() == window.slot_mapping[6:].tolist() == [-1, -1]  # padding writes nothing
    assert (window.block_tables[2:] == 0).all()  # the padding row
