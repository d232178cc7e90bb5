"""Multi-turn trajectories, one row each: its turns, the model's tokens per turn, the
environment's tokens, and its seconds in generation against its seconds in the environment.

Read from a rollout batch's columns (models/rollout_multiturn.py): runs of `loss_mask` = 1
are the model's turns, the runs between them the environment's observations.

    t = trajectories(batch_columns, uids, item_ids)
    t.table; t.figure        # also: table, fig = trajectories(...)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import pandas as pd
import plotly.graph_objects as go

from distflow_lab.observe.style import empty_figure

COLUMNS = ["uid", "item_id", "turns", "tokens_per_turn", "model_tokens", "env_tokens", "gen_s", "env_s", "reward"]
NEEDS = ("loss_mask", "response_mask", "turns", "gen_s", "env_s", "env_reward")


def runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """(value, length) of each run of equal values: [1, 1, 0, 1] -> [(1, 2), (0, 1), (1, 1)]."""
    out: list[tuple[int, int]] = []
    for v in mask:
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1] + 1)
        else:
            out.append((int(v), 1))
    return out


def trajectory_table(cols: Mapping[str, Any], uids: Sequence[Any] | None = None,
                     item_ids: Sequence[int] | None = None) -> pd.DataFrame:
    """One row per trajectory of a multi-turn rollout batch (see the module doc). KeyError naming the
    missing columns when the batch is not one."""
    missing = [k for k in NEEDS if k not in cols]
    if missing:
        raise KeyError(f"not a multi-turn rollout batch: no {missing} (rollout.multi_turn writes them)")
    rows = []
    for i in range(len(cols["turns"])):
        L = int(cols["response_mask"][i].sum())
        parts = runs(cols["loss_mask"][i][:L].tolist())
        rows.append({"uid": None if uids is None else str(uids[i]), "item_id": None if item_ids is None else
                     int(item_ids[i]), "turns": int(cols["turns"][i]),
                     "tokens_per_turn": [n for v, n in parts if v == 1],
                     "model_tokens": sum(n for v, n in parts if v == 1), "env_tokens": sum(n for v, n in parts if v == 0),
                     "gen_s": float(cols["gen_s"][i]), "env_s": float(cols["env_s"][i]),
                     "reward": float(cols["env_reward"][i])})
    return pd.DataFrame(rows, columns=COLUMNS)


def trajectory_figure(table: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Per trajectory: seconds in generation and in the environment (stacked bars), turns in the hover."""
    title = title or "trajectories: seconds in generation vs. in the environment"
    if not len(table):
        return empty_figure("no trajectories yet", title)
    t = table.sort_values("gen_s", key=lambda s: s + table.loc[s.index, "env_s"], ascending=False)
    x = [f"{u}/{i}" if u is not None else str(i) for u, i in zip(t["uid"], t.index)]
    hover = [f"{n} turns, tokens per turn {p}, {e} env tokens, reward {r:g}"
             for n, p, e, r in zip(t["turns"], t["tokens_per_turn"], t["env_tokens"], t["reward"])]
    fig = go.Figure([go.Bar(name=name, x=x, y=t[col], marker_color=color, customdata=hover,
                            hovertemplate="%{x}: %{y:.3f} s<br>%{customdata}<extra>" + name + "</extra>")
                     for name, col, color in (("generation", "gen_s", "#4C78A8"), ("environment", "env_s", "#9D755D"))])
    fig.update_layout(barmode="stack", title=title, xaxis_title="trajectory (uid/row)", yaxis_title="seconds",
                      height=360, margin=dict(l=50, r=20, t=50, b=40))
    return fig


@dataclass
class Trajectories:
    """Multi-turn trajectories: `table` (one row each), `summary` (means), `figure` (seconds per trajectory).
    `table, fig = s.trajectories()` unpacks."""

    table: pd.DataFrame
    figure: go.Figure

    @property
    def summary(self) -> pd.Series:
        t = self.table
        return pd.Series({"trajectories": len(t), "turns": t["turns"].mean(), "model_tokens": t["model_tokens"].mean(),
                          "env_tokens": t["env_tokens"].mean(), "gen_s": t["gen_s"].mean(),
                          "env_s": t["env_s"].mean(), "reward": t["reward"].mean()}, name="mean")

    def __iter__(self) -> Iterator:
        return iter((self.table, self.figure))

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.figure)
        display(self.table)

    def __repr__(self) -> str:
        return f"Trajectories ({len(self.table)})\n{self.summary.round(4).to_string()}"


def trajectories(cols: Mapping[str, Any], uids: Sequence[Any] | None = None,
                 item_ids: Sequence[int] | None = None, title: str | None = None) -> Trajectories:
    table = trajectory_table(cols, uids, item_ids)
    return Trajectories(table, trajectory_figure(table, title))
