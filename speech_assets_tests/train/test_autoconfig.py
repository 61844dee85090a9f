import pytest

from speech_assets.model.speed import profile_model
from speech_assets.train.autoconfig import (
    GIB,
    DatasetProfile,
    HardwareProfile,
    decide,
    profile_dataset,
)
from speech_assets.train.config import TrainConfig
from speech_assets_tests.support.training_data import SyntheticCorpus

LIBRISPEECH_LIKE = DatasetProfile(
    utterances=281_241,
    total_seconds=960 * 3600,
    mean_seconds=12.3,
    max_seconds=35.2,
)
SMALL = DatasetProfile(utterances=100, total_seconds=300.0, mean_seconds=3.0, max_seconds=6.0)


def test_cpu_box_trains_fp32_one_process_per_core_with_accumulation() -> None:
    hw = HardwareProfile(cpu_cores=2, ram_bytes=8 * GIB)
    plan = decide(hw, SMALL, profile_model("tiny", 2, 100), target_batch_seconds=240.0)
    assert (plan.device, plan.precision, plan.nproc, plan.threads_per_process) == ("cpu", "fp32", 2, 1)
    assert plan.batch_seconds <= 32.0 and plan.grad_accum == 4
    assert plan.effective_batch_seconds == pytest.approx(240.0, rel=0.01)
    assert "nproc 2" in plan.reason and "grad_accum 4" in plan.reason


def test_big_cpu_node_caps_processes_and_uses_threads() -> None:
    hw = HardwareProfile(cpu_cores=32, ram_bytes=128 * GIB)
    plan = decide(hw, SMALL, profile_model("tiny", 2, 100), target_batch_seconds=240.0)
    assert plan.nproc == 8 and plan.threads_per_process == 4
    assert plan.batch_seconds * plan.nproc * plan.grad_accum == pytest.approx(240.0, rel=0.01)


def test_small_gpu_without_bf16_uses_fp16_and_accumulates() -> None:
    hw = HardwareProfile(cpu_cores=8, ram_bytes=32 * GIB, gpu_count=1, gpu_name="Tesla T4", gpu_memory_bytes=15 * GIB)
    model = profile_model("base", 4, 500)
    plan = decide(hw, LIBRISPEECH_LIKE, model, target_batch_seconds=2800.0)
    assert (plan.device, plan.precision, plan.nproc) == ("cuda", "fp16", 1)
    usable = 0.85 * 15 * GIB - 2 * GIB - model.state_bytes
    assert plan.batch_seconds * 2 * model.activation_bytes_per_second_16bit <= usable
    assert plan.grad_accum > 1
    assert plan.effective_batch_seconds >= 2800.0 * 0.99


def test_h100_node_uses_bf16_all_gpus_and_no_accumulation() -> None:
    hw = HardwareProfile(
        cpu_cores=96,
        ram_bytes=1024 * GIB,
        gpu_count=8,
        gpu_name="NVIDIA H100 80GB HBM3",
        gpu_memory_bytes=80 * GIB,
        bf16_supported=True,
    )
    plan = decide(hw, LIBRISPEECH_LIKE, profile_model("base", 4, 500), target_batch_seconds=2800.0)
    assert (plan.device, plan.precision, plan.nproc, plan.grad_accum) == ("cuda", "bf16", 8, 1)
    assert plan.batch_seconds == pytest.approx(350.0)
    assert plan.threads_per_process == 4


def test_explicit_choices_win() -> None:
    hw = HardwareProfile(
        cpu_cores=16, ram_bytes=64 * GIB, gpu_count=2, gpu_name="X", gpu_memory_bytes=40 * GIB, bf16_supported=True
    )
    plan = decide(
        hw,
        SMALL,
        profile_model("tiny", 1, 50),
        100.0,
        nproc=1,
        batch_seconds=10.0,
        grad_accum=3,
        precision="fp32",
        device="cpu",
    )
    assert (plan.nproc, plan.batch_seconds, plan.grad_accum, plan.precision, plan.device) == (1, 10.0, 3, "fp32", "cpu")
    auto_accum = decide(hw, SMALL, profile_model("tiny", 1, 50), 100.0, nproc=2, batch_seconds=10.0)
    assert auto_accum.grad_accum == 5 and auto_accum.device == "cuda"


def test_impossible_requests_fail() -> None:
    cpu = HardwareProfile(cpu_cores=4, ram_bytes=8 * GIB)
    tiny = profile_model("tiny", 1, 50)
    with pytest.raises(ValueError, match="fp16"):
        decide(cpu, SMALL, tiny, 60.0, precision="fp16")
    with pytest.raises(ValueError, match="no GPU"):
        decide(cpu, SMALL, tiny, 60.0, device="cuda")
    small_gpu = HardwareProfile(cpu_cores=4, ram_bytes=8 * GIB, gpu_count=1, gpu_name="tiny", gpu_memory_bytes=3 * GIB)
    with pytest.raises(ValueError, match="memory"):
        decide(small_gpu, LIBRISPEECH_LIKE, profile_model("base", 1, 500), 2800.0)


def test_profiles(corpus: SyntheticCorpus) -> None:
    data = profile_dataset(corpus.shards)
    assert data.utterances == 52
    assert 1.5 <= data.mean_seconds <= 4.0 and data.max_seconds <= 4.0
    assert data.total_seconds == pytest.approx(data.mean_seconds * 52)
    model = profile_model("tiny", 2, [8, 12])
    assert model.parameters > 0.7e6
    assert model.adam_bytes == 8 * model.parameters and model.weight_bytes == 4 * model.parameters
    assert model.activation_bytes_per_second_16bit < model.activation_bytes_per_second_fp32
    with pytest.raises(ValueError):
        profile_model("tiny", 3, [8, 12])


def test_an_80_gb_gpu_gets_over_1000_s_of_audio_per_micro_batch_with_the_default_target() -> None:
    hw = HardwareProfile(
        cpu_cores=16,
        ram_bytes=256 * GIB,
        gpu_count=1,
        gpu_name="NVIDIA H100 80GB HBM3",
        gpu_memory_bytes=80 * GIB,
        bf16_supported=True,
    )
    model = profile_model("base", 4, 500, LIBRISPEECH_LIKE.mean_seconds)
    plan = decide(hw, LIBRISPEECH_LIKE, model, target_batch_seconds=TrainConfig.target_batch_seconds)
    assert plan.batch_seconds >= 1000.0 and plan.precision == "bf16"
    # it fits the memory budget, and the plan says why it is this large
    usable = 0.85 * 80 * GIB - 2 * GIB - model.state_bytes
    assert plan.batch_seconds * 2 * model.activation_bytes_per_second_16bit <= usable
    assert "target raised from 60 s to 2800 s" in plan.reason and "mostly idle" in plan.reason
    assert "TFLOP" in plan.reason and "989 TFLOP/s" in plan.reason
    # an explicit batch still wins, and a small corpus is not swallowed by one step
    assert decide(hw, LIBRISPEECH_LIKE, model, 60.0, batch_seconds=30.0).batch_seconds == 30.0
    small = decide(hw, SMALL, profile_model("base", 1, 50), 60.0)
    assert small.effective_batch_seconds <= max(60.0, SMALL.total_seconds / 10) * 1.01
