"""The compatibility layer: DeepSpeed internals are reached only through ds_bertopt.compat, and a release whose
hooks are missing or changed is refused before training in one line (or loses a capability with a note)."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from ds_bertopt.compat import deepspeed as ds_compat
from ds_bertopt.compat import transformers as hf_compat

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("ds_bertopt", "bench")
ALLOWED = {
    # (file, attribute): why it is not a DeepSpeed object's attribute
    ("ds_bertopt/comm/ddp.py", "loss_scale"): "DDPBucketClipState's own field (torch DDP, no DeepSpeed object)",
    ("ds_bertopt/testing/apex_lamb.py", "_dummy_overflow_buf"): "apex FusedLAMB's overflow buffer (apex's "
    "optimizers/fused_lamb.py, or this module's CPU stand-in), no DeepSpeed object",
}


def _deepspeed_private_names() -> set[str]:
    """Every ``_name`` the installed DeepSpeed assigns as an attribute or defines as a function or method."""
    root = Path(importlib.util.find_spec("deepspeed").origin).parent
    pattern = re.compile(r"\.(_[A-Za-z]\w*)\s*=|def (_[A-Za-z]\w*)\s*\(")
    names = set()
    for path in root.rglob("*.py"):
        for match in pattern.finditer(path.read_text(encoding="utf-8", errors="ignore")):
            names.add(match.group(1) or match.group(2))
    return names


def _reaches(tree: ast.AST, forbidden: set[str]):
    """(line, what) for each import of a non-public DeepSpeed module and each access to a forbidden attribute,
    written as ``x.name`` or as a constant in getattr/hasattr/setattr/delattr."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "deepspeed":
            if node.module not in ds_compat.PUBLIC_MODULES:
                yield node.lineno, f"from {node.module} import"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deepspeed" and alias.name not in ds_compat.PUBLIC_MODULES:
                    yield node.lineno, f"import {alias.name}"
        elif isinstance(node, ast.Attribute) and node.attr in forbidden:
            if not (
                node.attr.startswith("_") and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                yield node.lineno, f".{node.attr}"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in forbidden
        ):
            yield node.lineno, f"{node.func.id}(..., {node.args[1].value!r})"


def test_no_deepspeed_internal_is_reached_outside_compat():
    hooked = {name for hook in ds_compat.HOOKS for name in hook.attributes}
    forbidden = hooked | _deepspeed_private_names()
    found = []
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel.startswith("ds_bertopt/compat/"):
                continue
            for line, what in _reaches(ast.parse(path.read_text(encoding="utf-8")), forbidden):
                if (rel, what.strip(".").split("(")[0]) not in ALLOWED and (rel, what.lstrip(".")) not in ALLOWED:
                    found.append(f"{rel}:{line}: {what}")
    assert not found, "DeepSpeed internals outside ds_bertopt/compat (add a hook there):\n" + "\n".join(found)


def test_the_walk_catches_each_kind_of_reach():
    forbidden = {"reduce_ipg_grads", "_hp_mapping"}
    source = (
        "from deepspeed.runtime.zero.stage_1_and_2 import X\n"
        "import deepspeed.runtime.config\n"
        "opt.reduce_ipg_grads = f\n"
        "m = getattr(p, '_hp_mapping', None)\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "self._hp_mapping = 1\n"
    )
    got = [what for _, what in _reaches(ast.parse(source), forbidden)]
    assert got == [
        "from deepspeed.runtime.zero.stage_1_and_2 import",
        "import deepspeed.runtime.config",
        ".reduce_ipg_grads",
        "getattr(..., '_hp_mapping')",
    ], got


def test_every_hook_holds_where_it_was_read():
    """A hook holds on each release it lists; one that fails names a release outside its list (docs/compat.md)."""
    wrong = {
        name: problem
        for name, problem in ds_compat.problems().items()
        if ds_compat.version() in ds_compat.hook(name).checked
    }
    assert not wrong, wrong
    hf_compat.check_api()


def test_a_missing_hook_refuses_the_run_in_one_line_naming_it(monkeypatch):
    monkeypatch.setattr(ds_compat, "_checked", {"zero.reduce_ipg_grads": "reduce_ipg_grads takes (self, bucket)"})
    needed = ds_compat.needed_hooks(stage=2, precision="bf16", bucket_clip=True, lamb=False)
    with pytest.raises(ds_compat.DeepSpeedIncompatible) as caught:
        ds_compat.check_release(needed)
    message = str(caught.value)
    assert "\n" not in message and "hook zero.reduce_ipg_grads" in message and "bucket_clip at ZeRO 1/2" in message
    assert all(release in message for release in ds_compat.KNOWN_GOOD), message
    # a run that does not use the hook is not refused
    assert (
        ds_compat.check_release(ds_compat.needed_hooks(stage=2, precision="bf16", bucket_clip=False, lamb=False)) == []
    )


def test_a_missing_optional_hook_turns_its_capability_off_with_a_note(monkeypatch):
    monkeypatch.setattr(ds_compat, "_checked", {"data_sampling.batch_by_seqlens": "is missing"})
    notes = ds_compat.check_release(("data_sampling.batch_by_seqlens",))
    assert len(notes) == 1 and "is off" in notes[0] and "batch_by_seqlens" in notes[0]
    assert ds_compat.batch_by_seqlens() is None


def test_the_engine_preflight_refuses_before_deepspeed_initialize(monkeypatch):
    from ds_bertopt.config import BertOptConfig
    from ds_bertopt.configlib import load_section
    from ds_bertopt.engine import check_combinations

    monkeypatch.setattr(ds_compat, "_checked", {"zero.hp_mapping": "tensor_fragment has no hp_fragment"})
    bertopt = load_section(BertOptConfig, {"optimizer": {"type": "lamb"}}, "bertopt")
    with pytest.raises(ds_compat.DeepSpeedIncompatible, match=r"hook zero\.hp_mapping .*LAMB"):
        check_combinations(bertopt, {"zero_optimization": {"stage": 1}})
    check_combinations(bertopt, {"zero_optimization": {"stage": 0}})  # LAMB at ZeRO 0 needs no mapping


def test_docs_compat_is_rendered_from_the_recorded_runs():
    sys.path.insert(0, str(REPO / "tests" / "compat"))
    import record

    assert record.RAW.is_dir() and list(record.RAW.glob("*.json")), "no recorded make test-compat run"
    text = (REPO / "docs" / "compat.md").read_text(encoding="utf-8")
    assert text == record.render(), "docs/compat.md differs from its records: python tests/compat/record.py"


def test_only_zero3_with_the_optimizer_offloaded_needs_the_zero3_offload_hook():
    def needs(stage, offload):
        shape = dict(stage=stage, precision="bf16", bucket_clip=False, lamb=False, offload=offload)
        return "zero3.offload" in ds_compat.needed_hooks(**shape)

    assert needs(3, True) and not needs(3, False) and not needs(2, True)
