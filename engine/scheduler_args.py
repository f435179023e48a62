"""The scheduler's knobs as command-line flags, shared by `serve` and `simulate`, so a setting
tried in the simulator is given to the server by the same flag.

Each flag maps to one `SchedulerConfig` field and defaults to that field's default (None here:
the field keeps its own). `scheduler_options` returns only the fields given, and refuses an
admission-control knob without `--admission`, or a knob beside the one that overrides it: either
would be accepted and do nothing.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Sequence

from engine.arg_types import non_negative_float, positive_float, positive_int, share_of_one, share_above_zero
from scheduler.config import SchedulerConfig


@dataclass(frozen=True)
class Knob:
    flag: str
    field: str
    parse: Callable[[str], object]
    metavar: str
    help: str
    needs_admission: bool = False
    read_by_admission: bool = False  # an SLO: admission judges by it whatever the policy
    replaces: str | None = None  # the field of a knob this one overrides: giving both is refused


KNOBS = (
    Knob("--aging-tokens-per-step", "aging_tokens_per_step", non_negative_float, "K",
         "sjf/srpt anti-starvation: predicted tokens forgiven per measured step waited"),
    Knob("--aging-tokens-per-s", "aging_tokens_per_s", non_negative_float, "RATE",
         "a fixed sjf/srpt aging rate per second, instead of --aging-tokens-per-step per measured step",
         replaces="aging_tokens_per_step"),
    Knob("--srpt-max-preempt-share", "srpt_max_preempt_share", share_of_one, "SHARE",
         "srpt never preempts a request past this share of its predicted (ranking) length"),
    Knob("--slo-ttft-interactive", "slo_ttft_interactive_s", positive_float, "S",
         "interactive tier's TTFT target in seconds (admission control, goodput policy)", read_by_admission=True),
    Knob("--slo-e2e-standard", "slo_e2e_standard_s", positive_float, "S",
         "standard tier's end-to-end target in seconds (admission control, goodput policy)", read_by_admission=True),
    Knob("--goodput-urgent-slack", "goodput_urgent_slack_s", non_negative_float, "S",
         "goodput policy: a request this close (seconds) to missing its SLO goes first"),
    Knob("--max-queued-tokens", "max_queued_tokens", positive_int, "N",
         "bound on queued token work (prompt + predicted output tokens), checked for every tier; default: "
         f"checked for batch requests only, at {SchedulerConfig.queue_bound_kv_multiple:g} times the KV "
         "cache's tokens",
         needs_admission=True),
    Knob("--batch-shed-share", "batch_shed_share", share_above_zero, "SHARE",
         "batch-tier requests are admitted only while the work queued in every tier is below this share "
         "of the bound",
         needs_admission=True),
)


def _flag_of(field: str) -> str:
    return next(knob.flag for knob in KNOBS if knob.field == field)


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    """`--admission` and every knob, each help naming its default."""
    parser.add_argument("--admission", action="store_true",
                        help="admission control: refuse (429) an interactive or standard request whose "
                             "predicted delay misses its tier's SLO, and any request past the queued-token "
                             "bound (--max-queued-tokens; by default only batch requests are bounded)")
    for knob in KNOBS:
        default = getattr(SchedulerConfig, knob.field)
        shown = "" if default is None else f" (default {default:g})"
        parser.add_argument(knob.flag, dest=knob.field, type=knob.parse, default=None, metavar=knob.metavar,
                            help=knob.help + shown)


def scheduler_options(args: argparse.Namespace, policies: Sequence[str] | None = None,
                      flag: str = "--policy") -> dict:
    """The SchedulerConfig fields the flags set: `enable_admission` and each knob given. With the
    `policies` that will run (serve's one, simulate's list, named by `flag`), a knob that neither
    one of them nor admission reads is refused, as an admission knob is without --admission: it
    would do nothing."""
    from scheduler.policies import POLICIES

    options = {"enable_admission": bool(args.admission)}
    policy_knobs = frozenset().union(*(factory.reads_knobs for factory in POLICIES.values()))
    for knob in KNOBS:
        value = getattr(args, knob.field)
        if value is None:
            continue
        if knob.needs_admission and not args.admission:
            raise ValueError(f"{knob.flag} needs --admission: without it nothing is refused")
        if knob.replaces is not None and getattr(args, knob.replaces) is not None:
            raise ValueError(f"{knob.flag} replaces {_flag_of(knob.replaces)}: give one of them")
        read_by_admission = knob.read_by_admission and args.admission
        if (policies is not None and knob.field in policy_knobs and not read_by_admission
                and not any(knob.field in POLICIES[policy].reads_knobs for policy in policies)):
            also = " (nor, without --admission, does admission)" if knob.read_by_admission else ""
            verb = "does" if len(policies) == 1 else "do"
            raise ValueError(f"{knob.flag}: {flag} {','.join(policies)} {verb} not read it{also}")
        options[knob.field] = value
    return options
