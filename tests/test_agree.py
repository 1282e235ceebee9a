"""Processes that must give alike what each gives (the init key, the global batch) are compared:
2 processes x 4 devices under spmdkit launch, each case refused in both, naming both processes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import spmdkit
from spmdkit._strategies._agree import batch_signature, spans_processes

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _launch_two import launch_two  # noqa: E402

sys.path.remove(str(HERE))


@pytest.fixture(scope="module")
def raised(tmp_path_factory):
    out = tmp_path_factory.mktemp("agree") / "raised.json"
    launch_two(HERE / "_agree_mp_program.py", str(out), timeout=400)
    got = [json.loads(Path(f"{out}.{i}").read_text()) for i in (0, 1)]
    assert got[0] == got[1]  # both processes raised, the same error: they stayed in step
    return got[0]


def test_the_same_key_and_batch_and_a_process_s_own_device_pass(raised):
    assert raised["same key and batch"] is None
    assert raised["own device"] is None  # a mesh of one process's devices: its own program


@pytest.mark.parametrize("case, strategy", [("key data", "DataParallel"), ("key sharded", "Sharded"),
                                            ("key ensemble", "Ensemble")])
def test_a_key_that_differs_between_processes_is_refused_at_init(raised, case, strategy):
    # Each process built "replicated" parameters of its own and trained on, silently.
    message = raised[case]
    assert message.startswith(f"{strategy}.init(make_state, rng): rng differs between processes "
                              "(key data: process 0 [0, 0], process 1 [0, 1])"), message
    assert "Fix: pass the same key in every process" in message and "jax.random.key(jax.process_index())" in message
    # The ensemble's members are not replicated: the message speaks of one global state, not of replicas.
    assert "its part of one global state" in message and "'replicated'" not in message


def test_an_int_seed_that_differs_is_refused(raised):
    assert "process 0 [0, 3], process 1 [0, 4]" in raised["key as int seed"]


@pytest.mark.parametrize("case, words", [
    ("rows", "DataParallel.step(train_step)(state, batch): batch['x'] differs between processes: "
             "process 0 has shape (16, 8) float32, process 1 has shape (24, 8) float32"),
    ("dtype", "DataParallel.evaluate(fn)(state, batch): batch['x'] differs between processes: "
              "process 0 has shape (16, 8) float32, process 1 has shape (16, 8) float64"),
    ("leaf", "DataParallel.apply(fn)(state, batch): batch['y'] differs between processes: "
             "process 0 has no batch['y'], process 1 has shape (16, 8) float32"),
])
def test_a_global_batch_that_differs_between_processes_is_refused_at_the_first_call(raised, case, words):
    # Both processes trained to the end on global arrays of different shapes, silently.
    assert raised[case].startswith(words), raised[case]
    assert "Fix: give every process the same global batch" in raised[case]


def test_fit_on_the_same_arrays_passes(raised):
    assert raised["fit same data"] is None
    assert raised["fit own timeout"] is None  # a process's own watchdog setting is not the run's


def test_a_pipeline_not_split_per_process_is_refused_and_one_split_passes(raised):
    # Each process's pipeline yields its share (8 of 16 rows) of every global batch: the same
    # share in both trained each example twice, a batch of 8 for 16, without a word.
    said = raised["fit pipeline unsplit"]
    assert said is not None and said.startswith(
        "fit: task.train_data's first batch is the same in processes 0, 1 (CRC-32 "), said
    assert "(8 of batch_size=16 rows)" in said and "each of its examples 2 times" in said, said
    assert "Fix: split the pipeline per process: a Grain sampler with shard_options=grain.ShardByJaxProcess()" in said
    assert raised["fit pipeline split"] is None
    assert raised["fit pipeline of ones"] is None  # rows all alike: alike by chance, not refused


@pytest.mark.parametrize("case, words", [
    ("fit rows", "fit: task.train_data differs between processes: process 0 has 32 rows (CRC-32 "),
    ("fit eval values", "fit: task.eval_data differs between processes: process 0 has 32 rows (CRC-32 "),
])
def test_fit_on_arrays_that_differ_between_processes_is_refused(raised, case, words):
    # Each process took its rows of every global batch from its own copy: both trained to the end
    # on a mix of the two (other lengths, other seeds), silently.
    assert raised[case].startswith(words), raised[case]
    assert ("process 1 has 40 rows" if case == "fit rows" else "process 1 has 32 rows") in raised[case]
    assert "Fix: give every process the same task." in raised[case]


@pytest.mark.parametrize("case, words", [
    ("fit steps", "fit: TrainConfig.steps differs between processes: process 0 has 1, process 1 has 2."),
    ("fit model", "fit: state differs between processes: process 0 has state.params['w'] (8, 1) float32, process 1 "
                  "has state.params['w'] (8, 2) float32."),
    ("fit lr", "fit: optimizer differs between processes: step_size -0.1 -> -0.2 (in scale) (from process 0's to "
               "process 1's)."),
    ("fit resume", "fit: CheckpointConfig.resume differs between processes: process 0 has True, process 1 has False."),
    ("fit checkpoint in one", "fit: CheckpointConfig differs between processes: process 0 has none, process 1 has one."),
    ("init state", "DataParallel.init(make_state, rng): make_state builds another state in process 1 than in process "
                   "0: state['w'] (8, 4) float32 in process 0, state['w'] (8, 5) float32 in process 1."),
])
def test_settings_or_states_that_differ_between_processes_are_refused_before_any_step(raised, case, words):
    # Each left one process waiting for ever in a collective the other never reached (a resume in
    # process 0 alone: both, with no message; other --steps: the finished one 5 minutes in JAX's exit).
    assert raised[case].startswith(words), raised[case]
    fixes = {"fit steps": "(on the command line: the same --steps in every process)",
             "fit model": "build the same model (task.init) and optimizer in every process",
             "fit lr": "--optimizer, --lr, --momentum and --weight-decay",
             "fit resume": "(on the command line: the same --resume in every process)",
             "fit checkpoint in one": "(on the command line: the same --checkpoint-dir in every process)",
             "init state": "build the same state in every process"}
    assert fixes[case] in raised[case], raised[case]


@pytest.mark.parametrize("case, first, other", [
    ("paths apart", "DataParallel.init: the init key", "DataParallel.step(train_step)(state, batch): the batch's layout"),
    ("checkpointer in one", "spmdkit.Checkpointer(...), opening a checkpoint directory",
     "DataParallel.init: the init key"),
])
def test_processes_on_different_paths_are_named_at_the_point_each_is(raised, case, first, other):
    # One resumed while the other started afresh: its batch check read the other's init key as a
    # batch (an internal TypeError) and the other said "rng differs"; a Checkpointer in one process
    # waited for ever in Orbax's barrier.
    message = raised[case]
    assert message.startswith(f"the processes are at different points of the program (process 0 at {first}; "
                              f"process 1 at {other})"), message
    assert "Fix: make every process take the same path" in message and "not in process 0 only" in message


def test_a_checkpointer_opened_otherwise_in_one_process_is_named(raised):
    # Another keep in one process was dropped without a word: process 0's deleted the steps.
    assert raised["checkpointer keep"].startswith("the processes opened the checkpoint directory with another "
                                                  "CheckpointConfig.keep: process 0 1, process 1 3."), raised["checkpointer keep"]


def test_fits_on_each_process_s_own_device_run_their_own_programs(raised):
    assert raised["fit own device"] is None  # process 0's second fit, alone, did not wait for process 1


def test_one_process_compares_nothing():
    assert not spans_processes(spmdkit.DataParallel().mesh)
    assert batch_signature({"x": np.zeros((4, 2), np.float32), "n": jax.numpy.zeros(4, jax.numpy.int32)}) == [
        ["['n']", [4], "int32"], ["['x']", [4, 2], "float32"]]
