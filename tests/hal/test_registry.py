import logging

import pytest
import torch

from deepinfer.hal import (
    SPECS, Backend, Capabilities, OpTable, OpUnavailableError, UnknownBackendError, UnsupportedInput,
    available_backends, register_backend, unregister_backend,
)


class HalfBackend(Backend):
    """Implements rms_norm only (by doubling the reference, so its use is visible)."""

    name = "halfway"
    capabilities = Capabilities(device_types=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))

    def implementations(self):
        return {"rms_norm": _doubled_rms_norm}

    def unsupported_reasons(self):
        return {"mla_sparse_decode": "no paged FP8 reader yet"}


def _doubled_rms_norm(x, weight, eps, residual=None):
    if x.dtype != torch.float32:
        raise UnsupportedInput(f"halfway rms_norm: x must be float32, got {x.dtype}")
    return 2 * SPECS["rms_norm"].reference(x, weight, eps, residual)


@pytest.fixture
def halfway():
    register_backend(HalfBackend)
    yield
    unregister_backend("halfway")


def test_reference_is_found_through_its_entry_point():
    assert "reference" in available_backends()
    table = OpTable("reference")
    assert set(table.sources) == set(SPECS)
    assert set(table.sources.values()) == {"reference"}


def test_unknown_backend_names_the_value_and_the_choices():
    with pytest.raises(UnknownBackendError, match=r"'nosuch'.*reference"):
        OpTable("nosuch")


def test_missing_op_is_refused_naming_op_and_backend(halfway):
    table = OpTable("halfway")
    x = torch.ones(2, 4)
    assert torch.equal(table.rms_norm(x, torch.ones(4), 1e-6), 2 * SPECS["rms_norm"].reference(x, torch.ones(4), 1e-6))
    with pytest.raises(OpUnavailableError, match=r"'mla_sparse_decode'.*'halfway'.*no paged FP8 reader yet"):
        table.mla_sparse_decode()


def test_explicit_fallback_runs_the_reference_and_logs(halfway, caplog):
    with caplog.at_level(logging.WARNING):
        table = OpTable("halfway", fallback="reference")
    assert table.sources["rms_norm"] == "halfway"
    assert table.sources["apply_rope"] == "reference"
    assert any("apply_rope" in r.message and "falling back" in r.message for r in caplog.records)


def test_inputs_a_backend_does_not_cover_run_on_the_configured_fallback(halfway, caplog):
    x, weight = torch.ones(2, 4, dtype=torch.float64), torch.ones(4)
    with pytest.raises(UnsupportedInput, match="x must be float32, got torch.float64"):
        OpTable("halfway").rms_norm(x, weight, 1e-6)
    table = OpTable("halfway", fallback="reference")
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert torch.equal(table.rms_norm(x, weight, 1e-6), SPECS["rms_norm"].reference(x, weight, 1e-6))
    assert [r.message for r in caplog.records if "rms_norm" in r.message] == \
        ["op rms_norm: halfway rms_norm: x must be float32, got torch.float64; running 'reference' for such calls, "
         "as configured (backend.fallback)"]
    assert torch.equal(table.rms_norm(x.float(), weight, 1e-6), 2 * SPECS["rms_norm"].reference(x.float(), weight, 1e-6))


def test_the_fallback_warning_keeps_no_reference_to_the_call(halfway, caplog):
    """A kept log record (pytest keeps them, so may a user's handler) must not hold the refused
    call's frames, or the tensors in them (a model's caches) outlive their engine."""
    import gc
    import weakref

    table = OpTable("halfway", fallback="reference")
    x = torch.ones(2, 4, dtype=torch.float64)
    alive = weakref.ref(x)
    with caplog.at_level(logging.WARNING):
        table.rms_norm(x, torch.ones(4), 1e-6)
    del x
    gc.collect()
    assert any("rms_norm" in r.message for r in caplog.records)
    assert alive() is None, "the log record holds the refused call's inputs"


def test_per_op_override_takes_the_op_from_another_backend(halfway):
    table = OpTable("reference", overrides={"rms_norm": "halfway"})
    assert table.sources["rms_norm"] == "halfway"
    assert table.sources["linear"] == "reference"
    with pytest.raises(ValueError, match="unknown ops"):
        OpTable("reference", overrides={"no_such_op": "reference"})


def test_backend_must_declare_name_and_capabilities():
    with pytest.raises(TypeError, match="lowercase identifier"):
        type("Bad", (Backend,), {"name": "Bad-Name", "capabilities": HalfBackend.capabilities})
    with pytest.raises(TypeError, match="capabilities"):
        type("Bare", (Backend,), {"name": "bare"})


def test_every_op_has_tiny_and_real_cases():
    for name, spec in SPECS.items():
        sizes = {c.size for c in spec.cases}
        assert "tiny" in sizes and "real" in sizes, f"op {name} needs tiny and real cases, has {sizes}"


def test_backend_options_are_typed_and_reach_the_chosen_backend_only():
    """``backend.options`` build the chosen backend's typed options (one instance per distinct
    set); a backend without options, an unknown option and a bad value are refused by name."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Knobs:
        scale: int = 1

        def __post_init__(self):
            if self.scale not in (1, 2):
                raise ValueError(f"backend.options.scale={self.scale!r}: expected 1 or 2")

    class Knobbed(Backend):
        name = "knobbed"
        options_type = Knobs
        capabilities = Capabilities(device_types=frozenset({"cpu"}), dtypes=frozenset({torch.float32}))

        def implementations(self):
            scale = self.options.scale
            return {"rms_norm": lambda x, weight, eps, residual=None: scale * SPECS["rms_norm"].reference(
                x, weight, eps, residual)}

    register_backend(Knobbed)
    try:
        x, w = torch.randn(3, 8), torch.ones(8)
        want = SPECS["rms_norm"].reference(x, w, 1e-6)
        doubled = OpTable("knobbed", fallback="reference", options={"scale": 2})
        assert doubled.backend.options == Knobs(2) and torch.equal(doubled.rms_norm(x, w, 1e-6), 2 * want)
        assert torch.equal(OpTable("knobbed", fallback="reference").rms_norm(x, w, 1e-6), want)
        assert OpTable("reference", overrides={"rms_norm": "knobbed"}).rms_norm(x, w, 1e-6).equal(want), \
            "an override takes the backend's default options"
        with pytest.raises(ValueError, match=r"backend 'knobbed' has no options \['size'\]; its options: \['scale'\]"):
            OpTable("knobbed", fallback="reference", options={"size": 2})
        with pytest.raises(ValueError, match=r"backend.options.scale=3: expected 1 or 2"):
            OpTable("knobbed", fallback="reference", options={"scale": 3})
        with pytest.raises(ValueError, match=r"backend 'reference' takes no options"):
            OpTable("reference", options={"scale": 2})
    finally:
        unregister_backend("knobbed")


def test_sm100_options_compose_from_the_config():
    from deepinfer.config.compose import compose

    app = compose(["backend=sm100", "backend.options.mla_kernel=portable"])
    table = OpTable(app.backend.name, "reference", options=dict(app.backend.options))
    assert table.backend.options.mla_kernel == "portable" and table.backend.options.tcgen05 is False
    with pytest.raises(ValueError, match=r"mla_kernel='fast'"):
        OpTable("sm100", "reference", options={"mla_kernel": "fast"})
