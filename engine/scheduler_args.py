"""The scheduler's knobs as command-line flags, shared by `serve` and `simulate`, so a setting
tried in the simulator is given to the server by the same flag.

Each flag maps to one `SchedulerConfig` field and defaults to that field's default (None here:
the field keeps its own). `scheduler_options` returns only the fields given, and refuses an
admission-control knob without `--admission`: it would be accepted and do nothing.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from engine.arg_types import non_negative_float, positive_int, share_of_one, share_above_zero
from scheduler.config import SchedulerConfig


@dataclass(frozen=True)
class Knob:
    flag: str
    field: str
    parse: Callable[[str], object]
    metavar: str
    help: str
    needs_admission: bool = False


KNOBS = (
    Knob("--aging-tokens-per-step", "aging_tokens_per_step", non_negative_float, "K",
         "sjf/srpt anti-starvation: predicted tokens forgiven per measured step waited"),
    Knob("--aging-tokens-per-s", "aging_tokens_per_s", non_negative_float, "RATE",
         "a fixed sjf/srpt aging rate per second, instead of --aging-tokens-per-step per measured step"),
    Knob("--srpt-max-preempt-share", "srpt_max_preempt_share", share_of_one, "SHARE",
         "srpt never preempts a request past this share of its predicted length"),
    Knob("--slo-ttft-interactive", "slo_ttft_interactive_s", non_negative_float, "S",
         "interactive tier's TTFT target in seconds (admission control, goodput policy)"),
    Knob("--slo-e2e-standard", "slo_e2e_standard_s", non_negative_float, "S",
         "standard tier's end-to-end target in seconds (admission control, goodput policy)"),
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


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    """`--admission` and every knob, each help naming its default."""
    parser.add_argument("--admission", action="store_true",
                        help="admission control: refuse (429) requests whose tier SLO cannot be met or whose "
                             "queue is full, batch tier first")
    for knob in KNOBS:
        default = getattr(SchedulerConfig, knob.field)
        shown = "" if default is None else f" (default {default:g})"
        parser.add_argument(knob.flag, dest=knob.field, type=knob.parse, default=None, metavar=knob.metavar,
                            help=knob.help + shown)


def scheduler_options(args: argparse.Namespace) -> dict:
    """The SchedulerConfig fields the flags set: `enable_admission` and each knob given."""
    options = {"enable_admission": bool(args.admission)}
    for knob in KNOBS:
        value = getattr(args, knob.field)
        if value is None:
            continue
        if knob.needs_admission and not args.admission:
            raise ValueError(f"{knob.flag} needs --admission: without it nothing is refused")
        options[knob.field] = value
    return options
