"""Every config composes into a valid AppConfig, errors name what is wrong, and every model
preset builds its architecture config (and, cheaply, its model)."""
import dataclasses
import re
import subprocess
import sys

import hydra
import pytest
import torch
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from deepinfer.config.compose import compose, group_options
from deepinfer.config.schema import AppConfig, ConfigError, DecodingConfig, to_app_config
from deepinfer.hal import OpTable
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.registry import CONFIG_ROOT, build_config, model_preset
from deepinfer.study import compose_study, load_script

GROUPS = sorted(path.name for path in CONFIG_ROOT.iterdir() if path.is_dir())
GROUP_OPTIONS = [(group, option) for group in GROUPS for option in group_options(group)]


def test_every_group_has_options():
    assert {"model", "backend", "parallel", "decoding", "engine", "experiment"} <= set(GROUPS)
    assert all(group_options(group) for group in GROUPS if group != "experiment")


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_option_composes(group, option):
    study = group == "experiment" and re.search(r"^\s*-\s*/study:", (CONFIG_ROOT / group / f"{option}.yaml").read_text(), re.M)
    if study:
        with pytest.raises(ConfigError, match=f"python experiments/{option}.py"):
            compose([f"{group}={option}"])
        app, _ = compose_study(option, load_script(option).Settings, [])
    else:
        app = compose([f"{group}={option}"])
    assert isinstance(app, AppConfig)
    section = getattr(app, group, None)
    if section is not None and "name" in {f.name for f in dataclasses.fields(section)}:
        assert section.name == option, f"configs/{group}/{option}.yaml names itself {section.name!r}"


def test_defaults_and_overrides_apply():
    app = compose()
    assert (app.model.name, app.backend.name, app.parallel.name, app.decoding.name) == (
        "tiny", "reference", "single", "greedy")
    app = compose(["decoding.temperature=0.5", "decoding=sample", "+backend.overrides.mla_sparse_decode=reference",
                   "prompt=hello"])
    assert app.decoding.temperature == 0.5 and app.decoding.top_p == 0.95
    assert app.backend.overrides == {"mla_sparse_decode": "reference"}
    assert app.prompt == "hello"
    assert compose().decoding.temperature == 0.0, "an override leaked into the next composition"
    assert not GlobalHydra.instance().is_initialized()


def test_experiment_is_a_delta():
    app = compose(["experiment=tiny_sampled"])
    assert (app.decoding.name, app.decoding.seed, app.decoding.max_tokens) == ("sample", 1234, 32)
    assert app.engine == compose().engine


@pytest.mark.parametrize("group", ["model", "backend", "parallel", "decoding", "engine", "experiment"])
def test_unknown_option_lists_the_available_ones(group):
    with pytest.raises(ValueError) as error:
        compose([f"{group}=nosuch"])
    message = str(error.value)
    assert f"unknown {group} option 'nosuch'" in message
    assert all(option in message for option in group_options(group))


@pytest.mark.parametrize("override,expected", [
    ("decoding.top_p=1.5", "decoding.top_p=1.5"),
    ("decoding.top_p=0", "decoding.top_p=0.0"),
    ("decoding.top_k=-2", "decoding.top_k=-2"),
    ("decoding.num_draft_tokens=-1", "decoding.num_draft_tokens=-1"),
    ("engine.scheduler=vllm", "engine.scheduler='vllm'"),
    ("decoding.verify_cost=guess", "decoding.verify_cost='guess'"),
    ("decoding.max_tokens=-1", "decoding.max_tokens=-1"),
    ("decoding.temperature=-0.1", "decoding.temperature=-0.1"),
    ("model.dtype=fp8", "model.dtype='fp8'"),
    ("engine.prefill_chunk_tokens=4096", "engine.prefill_chunk_tokens=4096"),
    ("parallel.expert_parallel=0", "parallel.expert_parallel=0"),
    ("decoding.temperature=hot", "decoding.temperature"),
    ("decoding.nosuch=1", "decoding.nosuch"),
])
def test_invalid_values_name_the_key(override, expected):
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        compose([override])


def test_filter_order_defaults_to_deepinfer_and_refuses_other_values_naming_the_choices():
    assert compose().decoding.filter_order == "deepinfer"
    assert compose(["decoding=sample"]).decoding.filter_order == "deepinfer"
    assert compose(["decoding=dspark"]).decoding.filter_order == "deepinfer"
    assert compose(["decoding=sample", "decoding.filter_order=vllm"]).decoding.filter_order == "vllm"
    with pytest.raises(ConfigError, match=r"decoding\.filter_order='topk_first' is invalid: use one of "
                                          r"\['deepinfer', 'vllm'\]"):
        compose(["decoding.filter_order=topk_first"])
    with pytest.raises(ConfigError, match=r"decoding\.filter_order='DeepInfer'"):
        DecodingConfig(filter_order="DeepInfer")


def test_prompt_and_prompts_file_are_exclusive():
    with pytest.raises(ConfigError, match="not both"):
        compose(["prompt=hi", "prompts_file=prompts.txt"])


def test_to_app_config_needs_the_schema():
    with pytest.raises(ConfigError, match="AppConfig"):
        to_app_config(OmegaConf.create({"model": {"name": "tiny"}}))


def test_compose_inside_a_running_hydra_app(tmp_path):
    (tmp_path / "app.yaml").write_text("answer: 42\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        app_hydra = GlobalHydra.instance().hydra
        assert compose(["decoding.temperature=0.5"]).decoding.temperature == 0.5
        assert GlobalHydra.instance().hydra is app_hydra
        assert hydra.compose("app").answer == 42


def test_cli_refuses_unknown_task_and_writes_nothing(tmp_path):
    run = subprocess.run([sys.executable, "-m", "deepinfer", "task=train"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0
    assert "task='train' is not available yet" in run.stderr
    assert not [path for path in tmp_path.rglob("*") if path.is_file()]


MODELS = group_options("model")


@pytest.mark.parametrize("name", MODELS)
def test_model_preset_builds_its_config(name):
    preset = model_preset(name)
    cfg = build_config(preset)
    assert isinstance(cfg, DeepseekV41Config)
    assert cfg.vocab_size == preset["config"]["vocab_size"]
    assert compose([f"model={name}"]).model.config == preset["config"]


def test_tiny_model_instantiates():
    preset = model_preset("tiny")
    model = DeepseekV41ForCausalLM(build_config(preset), OpTable("reference"), max_model_len=preset["max_model_len"])
    assert 1e5 < sum(p.numel() for p in model.parameters()) < 1e7


def _meta_parameter_count(name: str) -> int:
    preset = model_preset(name)
    with torch.device("meta"):
        model = DeepseekV41ForCausalLM(build_config(preset), OpTable("reference"),
                                       dtype=getattr(torch, preset["dtype"]), max_model_len=preset["max_model_len"])
    return sum(p.numel() for p in model.parameters())


def test_full_size_models_have_plausible_sizes():
    small, flash = _meta_parameter_count("small"), _meta_parameter_count("v41_flash")
    assert 1e9 < small < 10e9
    assert 100e9 < flash < 1e12
