"""Deployment exports of a tuned profile: vLLM serve settings and this engine's own.

vLLM: the Vegas authors' vLLM fork adds a ``sparse_attn`` speculative method. Its
speculative config carries gamma, the algorithm (``vegas`` or ``streamingllm``), the
sparsity ratio and the minimum budget, and it validates them: ``num_speculative_tokens``
> 0, 0 < ``sparse_attn_ratio`` < 1 (strictly: a ratio of 1, dense drafts, is not servable
there), no unknown keys. The fork has no setting for ``collect``, ``score``,
``granularity``, ``window`` or ``rule``: it collects the first and last verify rows over
all query heads into one top-k per layer, ranks by softmax weights (a code constant),
reserves no sink/window share, and chooses its candidates, budget and streaming window
by its own rule (this engine's ``rule: fork``, docs/drafters.md). It sizes its score
buffer from ``max_num_seqs`` x ``max_model_len``, so the serve config sets both: the
served concurrency and the tuned context plus new tokens.

A profile records the target it was tuned for (``vllm``: only what the fork runs was
searched; ``vegas``: every option of this engine). ``render_export`` to the other target
is refused unless forced: what is exported is then not what was measured.

A profile holds one schedule entry per tuned batch size; the export serves one
concurrency (``serve_batch``, by default the largest tuned size) with the entry whose
range holds it. Where that entry is ``vanilla`` (nothing beat vanilla decoding there),
``render_export`` exports vanilla decoding unless told to ``force`` the entry's measured
speculative settings:

- vllm, yaml: the serve config without its ``speculative-config`` key (a ``# `` comment
  says why); vllm, json: ``null``, which ``--speculative-config`` reads as "no
  speculative decoding";
- vegas, yaml or json: ``null``, standing for ``spec=None``, which is how
  ``vegas_core.generate`` decodes plainly (``SpecConfig(**settings)`` on it fails loudly
  rather than speculating with defaults).

With ``per_batch_size`` (target vllm), the speculative config also carries the whole
schedule as vLLM's per-batch-size table (``num_speculative_tokens_per_batch_size``:
inclusive ``[batch_min, batch_max, K]`` ranges, K = 0 where the schedule runs vanilla)
and ``num_speculative_tokens`` becomes the largest K (vLLM sizes its buffers for it and
clamps the table to it). One fork config fixes the drafter and budget for every batch
size, so they come from the served entry (or, where it runs vanilla, the speculative
entry of the largest batch size); the note names each range that was measured with
another selection or budget. vLLM reads the table since its dynamic speculative
decoding (pull request 32374); the authors' fork, built on an earlier vLLM, rejects
unknown speculative keys, so the table is for a vLLM that runs both. A profile tuned at
several contexts gives the table of its longest context's band (what the served entry
and the headline come from); with ``context_ranges`` as well, every band, in the
context form proposed in vLLM's RFC 48627 (``[batch_min, batch_max, ctx_min, ctx_max,
K]``, read by no release yet), the last band reaching the served ``max-model-len``.

vegas: the keyword arguments of ``vegas_core.SpecConfig`` for the same settings.
``recommendation_note`` gives the one line the CLI prints on stderr for a vanilla entry.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from vegas_core.errors import VegasError
from vegas_tune.profile import VANILLA, Profile, ScheduleEntry, Tuned
from vegas_tune.serving import (JSON_INDENT, VLLM_BATCH_TABLE_KEY, VLLM_CONTEXT_FORM,
                                VLLM_SPECULATIVE_KEY, engine_settings, speculative_json,
                                vllm_batch_table, vllm_context_table, vllm_note,
                                vllm_serve_config)

EXPORT_TARGETS = ("vllm", "vegas")
EXPORT_FORMATS = ("yaml", "json")

# What a vanilla entry exports by default: no speculative settings at all.
VANILLA_TEXT = "null\n"


def max_model_len(profile: Profile) -> int:
    """Positions a served sequence needs: the tuned context plus the new tokens."""
    return profile.workload.ctx + profile.workload.max_new_tokens


def served_entry(profile: Profile, serve_batch: int | None) -> tuple[int, ScheduleEntry]:
    """(the served concurrency, the schedule entry for it). ``serve_batch`` None means
    the largest tuned size; a size outside 1 .. that size is refused (``VegasError``)."""
    largest = profile.headline.batch_size
    if serve_batch is None:
        return largest, profile.headline
    if not 1 <= serve_batch <= largest:
        sizes = ", ".join(str(e.batch_size) for e in profile.entries_at())
        # Only a size above the largest can be fixed by tuning further.
        retune = (f", or re-tune with --batch-size up to {serve_batch}"
                  if serve_batch > largest else "")
        raise VegasError(f"--serve-batch {serve_batch} lies outside the tuned sizes ({sizes}); "
                         f"give 1 to {largest}{retune}")
    return serve_batch, profile.entry_for(serve_batch)


class _Dumper(yaml.SafeDumper):
    """Block style, except lists of numbers (the per-batch-size table's [lo, hi, K])."""

    def represent_list(self, data):
        flow = bool(data) and all(isinstance(x, int | float) for x in data)
        return self.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)


_Dumper.add_representer(list, _Dumper.represent_list)


def _yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     allow_unicode=True)


def _json(data: Any) -> str:
    return json.dumps(data, indent=JSON_INDENT) + "\n"


def _comment(text: str) -> str:
    """``text`` as YAML comment lines, so the rendered file still parses to the config."""
    return "".join(f"# {line}\n" for line in text.splitlines())


def check_target(profile: Profile, target: str, force: bool, source: str) -> str | None:
    """Refuse (``VegasError``) an export to another target than the profile was tuned
    for, unless ``force``; then the warning line to print. None when the targets agree."""
    if target not in EXPORT_TARGETS:
        raise VegasError(f"unknown export target '{target}'; choose one of: "
                         f"{', '.join(EXPORT_TARGETS)}")
    if target == profile.target:
        return None
    what = {"vllm": "only what the vLLM fork runs", "vegas": "every option of this engine"}
    if not force:
        raise VegasError(
            f"{source} was tuned for --target {profile.target} ({what[profile.target]}); "
            f"exporting it for {target} serves a configuration that was not measured there: "
            f"re-tune with --target {target}, or pass --force")
    return (f"warning: {source} was tuned for {profile.target}; exporting for {target} as "
            "--force asks: the figures in the profile were not measured for this target")


def check_table_options(profile: Profile, per_batch_size: bool, context_ranges: bool) -> None:
    """Refuse (``VegasError``) ``context_ranges`` without ``per_batch_size`` (it shapes
    that table), or for a profile tuned at one context (it has no context ranges)."""
    if context_ranges and not per_batch_size:
        raise VegasError("--context-ranges shapes vLLM's per-batch-size table: pass "
                         "--per-batch-size too")
    if context_ranges and profile.workload.contexts is None:
        raise VegasError(f"--context-ranges: the profile was tuned at one context "
                         f"({profile.workload.ctx} tokens), so it has no context ranges; "
                         "drop --context-ranges, or re-tune at several (e.g. --ctx "
                         "4k,16k,32k)")


def render_export(profile: Profile, target: str, fmt: str, force: bool = False,
                  serve_batch: int | None = None, per_batch_size: bool = False,
                  context_ranges: bool = False) -> str:
    """Render the serving settings for ``serve_batch`` concurrent sequences (default: the
    largest tuned size) as text, from the schedule entry for that size.

    target ``vllm``: fmt ``yaml`` gives the serve config for ``vllm serve --config``
    (with ``max-num-seqs`` = ``serve_batch``), preceded by the note as a ``# `` comment;
    fmt ``json`` gives the speculative config JSON that ``--speculative-config`` takes.
    target ``vegas``: this engine's settings as YAML or JSON.
    An entry that runs vanilla renders vanilla decoding instead (see the module
    docstring) unless ``force`` is true. An unknown target or format, or a
    ``serve_batch`` outside the tuned sizes, raises ``VegasError``.
    ``per_batch_size`` (vllm only) adds vLLM's per-batch-size table, in its context form
    with ``context_ranges`` (a profile tuned at several contexts only).
    """
    if target not in EXPORT_TARGETS:
        raise VegasError(f"unknown export target '{target}'; choose one of: "
                         f"{', '.join(EXPORT_TARGETS)}")
    if fmt not in EXPORT_FORMATS:
        raise VegasError(f"unknown export format '{fmt}'; choose one of: "
                         f"{', '.join(EXPORT_FORMATS)}")
    check_table_options(profile, per_batch_size, context_ranges)
    batch, entry = served_entry(profile, serve_batch)
    if per_batch_size:
        if target != "vllm":
            raise VegasError("--per-batch-size writes vLLM's table; this engine follows "
                             "the profile's schedule itself (vegas generate --profile)")
        return _render_batch_table(profile, fmt, batch, entry, context_ranges)
    tuned = entry.speculative if force or entry.config != VANILLA else None
    if target == "vllm":
        model_id = profile.exports.vllm.serve_config["model"]
        serve = vllm_serve_config(model_id, tuned, batch, max_model_len(profile))
        if fmt == "json":
            return speculative_json(tuned) + "\n"
        note = vllm_note(tuned, profile.target) if tuned is not None else _vanilla_note(entry, batch)
        return _comment(note) + _yaml(serve)
    if tuned is None:
        return _comment(_vanilla_note(entry, batch)) + VANILLA_TEXT if fmt == "yaml" else VANILLA_TEXT
    settings = engine_settings(tuned)
    return _yaml(settings) if fmt == "yaml" else _json(settings)


# Said of a per-batch-size export: who reads the table.
BATCH_TABLE_NOTE = (
    "num_speculative_tokens_per_batch_size is vLLM's per-batch-size table (dynamic "
    "speculative decoding, vLLM pull request 32374): K per inclusive range of live batch "
    "sizes, 0 where this profile runs vanilla. The authors' fork, built on an earlier "
    "vLLM, rejects it as an unknown key.")


# Said of a context-form export: who reads it, and what its contexts are.
CONTEXT_TABLE_NOTE = (
    f"Its entries are in the context form proposed in vLLM's {VLLM_CONTEXT_FORM} "
    "([batch_lo, batch_hi, ctx_lo, ctx_hi, K], pull request 48944), which no vLLM "
    "release reads yet. The contexts were tuned as the mean tokens per live sequence; "
    "the last band runs to max-model-len.")


def _band_ranges(entries: list[ScheduleEntry], batch: int
                 ) -> list[tuple[int, int, Tuned | None]]:
    """(batch_min, batch_max, configuration or None for vanilla) of ``entries`` that a
    server of ``batch`` sequences reaches."""
    return [(e.batch_min, e.batch_max, None if e.config == VANILLA else e.config)
            for e in entries if e.batch_min <= batch]


def _render_batch_table(profile: Profile, fmt: str, batch: int, entry: ScheduleEntry,
                        context_ranges: bool = False) -> str:
    """The vLLM export of the whole schedule up to ``batch`` sequences (see the module
    docstring); ``VegasError`` when no entry runs speculatively."""
    speculative = [e for e in profile.schedule if e.config != VANILLA]
    if not speculative:
        raise VegasError("the schedule runs vanilla at every batch size: there is no "
                         "speculative configuration to give a table")
    # The served entry is of the longest context's band; so is the last entry.
    served = entry.config if entry.config != VANILLA else speculative[-1].config
    if context_ranges:
        bands = []
        for ctx in profile.contexts:
            entries = profile.entries_at(ctx)
            # The last band covers every longer context, up to what the server admits.
            ctx_max = (max(entries[0].ctx_max, max_model_len(profile))
                       if ctx == profile.contexts[-1] else entries[0].ctx_max)
            bands.append((entries[0].ctx_min, ctx_max, _band_ranges(entries, batch)))
        table, unmeasured = vllm_context_table(bands, served)
    else:
        table, unmeasured = vllm_batch_table(_band_ranges(profile.entries_at(), batch), served)
    model_id = profile.exports.vllm.serve_config["model"]
    serve = vllm_serve_config(model_id, served, batch, max_model_len(profile))
    speculative_config = serve.get(VLLM_SPECULATIVE_KEY)
    if speculative_config is None:
        raise VegasError(f"the fork cannot run {served.drafter} at sparsity ratio "
                         f"{served.sparsity_ratio:g}: there is no speculative config to "
                         "give a table")
    speculative_config["num_speculative_tokens"] = max(row[-1] for row in table) or served.gamma
    speculative_config[VLLM_BATCH_TABLE_KEY] = table
    if fmt == "json":
        return _json(speculative_config)
    note = vllm_note(served, profile.target) + " " + BATCH_TABLE_NOTE
    if context_ranges:
        note += " " + CONTEXT_TABLE_NOTE
    elif profile.workload.contexts is not None:
        contexts = ", ".join(map(str, profile.contexts))
        note += (f" Tuned at contexts {contexts}: this table is the {profile.contexts[-1]} "
                 "band's; --context-ranges gives every band.")
    if unmeasured:
        note += (" vLLM runs this config's drafter and budget at every batch size; these "
                 "ranges were measured with others: " + "; ".join(unmeasured) + ".")
    return _comment(note) + _yaml(serve)


def _vanilla_note(entry: ScheduleEntry, batch: int) -> str:
    return (f"Vanilla decoding at {batch} concurrent sequences: no speculative configuration "
            f"beat it reliably there (measured at batch {entry.batch_size}: "
            f"{_speedup_words(entry)}), so this config has no speculative decoding.")


def _speedup_words(entry: ScheduleEntry) -> str:
    r = entry.results
    if r.speedup is None:
        return "not measured against vanilla"
    if r.speedup_interval is None:
        return f"speedup {r.speedup:.2f}x, one round"
    low, high = r.speedup_interval
    return f"speedup {r.speedup:.2f}x, interval [{low:.2f}, {high:.2f}]"


def recommendation_note(profile: Profile, source: str, force: bool,
                        serve_batch: int | None = None) -> str | None:
    """The one stderr line ``export`` prints when the served entry runs vanilla (what was
    exported, and why); None when it runs speculatively."""
    batch, entry = served_entry(profile, serve_batch)
    if entry.config != VANILLA:
        return None
    why = (f"{source} runs vanilla at batch {batch} (measured at {entry.batch_size}: "
           f"{_speedup_words(entry)})")
    if force:
        return f"note: {why}: exporting the measured speculative settings anyway, as --force asks"
    return (f"warning: {why}: exporting vanilla decoding; pass --force to export the "
            "measured speculative settings")
