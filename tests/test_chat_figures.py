"""The chat page's pure figure helpers: the animated retained map and the replies' first divergence from Full."""

from __future__ import annotations

import json

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from kvlab.viz.chat import divergence_html, first_divergence, retained_animation, retained_map


def turns() -> list[dict]:
    """Three finished turns of a 2-layer, 2-KV-head cache at budget 6: early tokens leave as the talk grows."""
    segments: list[dict] = []
    out = []
    for t, (start, end) in enumerate([(0, 6), (6, 11), (11, 15)]):
        segments = segments + [{"start": start, "end": end - 2, "turn": t, "role": "user"},
                               {"start": end - 2, "end": end, "turn": t, "role": "assistant"}]
        keep = list(range(max(0, end - 6), end))
        sink = [0] + list(range(end - 5, end))
        out.append({"retained": [[keep, sink], [keep, keep]], "total": end, "segments": list(segments)})
    return out


def as_json(data) -> list[dict]:
    """Traces as plain JSON (numpy arrays included), so two figures' data compare by value."""
    return json.loads(pio.to_json({"data": list(data)}, validate=False))["data"]


@pytest.mark.parametrize("active", [None, 1, 2])
def test_the_animation_has_one_frame_per_turn_each_the_static_map_of_that_turn(active: int | None) -> None:
    rounds = turns()
    texts = [f"w{i}" for i in range(15)]
    fig = retained_animation(rounds, "h2o: kept tokens", texts=texts, active=active)
    assert len(fig.frames) == len(rounds)
    for k, (frame, turn) in enumerate(zip(fig.frames, rounds), start=1):
        static = retained_map(turn["retained"], turn["total"], turn["segments"], f"h2o: kept tokens after turn {k}",
                              texts=texts)
        static.data[0].text = None  # the token texts sit once in the figure, not in every frame
        assert frame.name == str(k)
        assert as_json(frame.data) == as_json(static.data)
        assert frame.layout.title.text == static.layout.title.text
    shown = (active or len(rounds)) - 1
    opened = go.Heatmap(fig.data[0]).update(text=None)
    assert as_json([opened]) == as_json(fig.frames[shown].data[:1])  # it opens on the chosen turn
    assert fig.data[0].text.shape == (2, 15) and fig.data[0].text[1][14] == "w14"  # every frame's hover reads these
    assert [t.name for t in fig.data[1:]] == ["turn 1", "turn 2", "turn 3"]  # every turn's legend entry from the start
    slider = fig.layout.sliders[0]
    assert slider.active == shown and [list(s.args[0]) for s in slider.steps] == [["1"], ["2"], ["3"]]
    assert [b.label for b in fig.layout.updatemenus[0].buttons] == ["▶ Play", "❚❚ Pause"]
    assert list(fig.layout.xaxis.range) == [-0.5, 14.5]  # fixed: cells go blank instead of the axis rescaling


def test_the_static_map_shows_token_text_and_the_head_share() -> None:
    turn = turns()[1]
    fig = retained_map(turn["retained"], turn["total"], turn["segments"], "t", texts=[f"w{i}" for i in range(11)])
    heat = fig.data[0]
    assert heat.text[0][7] == "w7" and "%{text}" in heat.hovertemplate
    # layer 0: head 0 keeps 5..10, head 1 keeps 0 and 6..10; so position 5 is kept by half the heads
    assert heat.customdata[0][5] == 50 and heat.customdata[0][6] == 100 and heat.customdata[1][0] == 0  # % of heads
    assert "pale" in fig.layout.legend.title.text


def test_an_animation_needs_a_turn() -> None:
    with pytest.raises(ValueError):
        retained_animation([], "t")


@pytest.mark.parametrize("ids, reference, expected", [
    ([1, 2, 3], [1, 2, 3], None),
    ([1, 2, 4], [1, 2, 3], 2),
    ([9, 2, 3], [1, 2, 3], 0),
    ([1, 2], [1, 2, 3], 2),  # stops early
    ([1, 2, 3, 4], [1, 2, 3], 3),  # goes on
    ([], [], None),
])
def test_first_divergence(ids: list[int], reference: list[int], expected: int | None) -> None:
    assert first_divergence(ids, reference) == expected


def decode(ids: list[int]) -> str:
    return "".join({1: "The", 2: " code", 3: " is", 4: " <b>", 5: " 41"}[i] for i in ids)


def test_the_reply_html_highlights_the_first_diverging_token_and_escapes_the_text() -> None:
    html = divergence_html([1, 2, 4, 5], [1, 2, 3, 5], decode)
    assert "The code<mark" in html and "&lt;b&gt;</mark>" in html and "<b>" not in html
    assert html.index("</mark>") < html.index(" 41")
    assert "same as Full" in divergence_html([1, 2], [1, 2], decode)
    assert "ends here" in divergence_html([1], [1, 2], decode)


def test_every_builtin_policy_and_baseline_has_its_own_colour() -> None:
    from kvlab.policies import POLICIES
    from kvlab.viz.colours import OTHER_COLOURS, POLICY_COLOURS, policy_colour

    builtin = [n for n in POLICIES if POLICIES[n].plugin is None]
    assert set(builtin) <= set(POLICY_COLOURS), set(builtin) - set(POLICY_COLOURS)
    assert len(set(POLICY_COLOURS.values())) == len(POLICY_COLOURS)
    assert not set(OTHER_COLOURS) & set(POLICY_COLOURS.values())
    assert policy_colour("a-plugin", 1) in OTHER_COLOURS and policy_colour("snapkv", 1) == POLICY_COLOURS["snapkv"]


def _lab(colour: str) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB hex colour."""
    linear = [((c + 0.055) / 1.055) ** 2.4 if c > 0.04045 else c / 12.92
              for c in (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))]
    xyz = [sum(w * c for w, c in zip(row, linear)) / white for row, white in
           (((0.4124, 0.3576, 0.1805), 0.95047), ((0.2126, 0.7152, 0.0722), 1.0), ((0.0193, 0.1192, 0.9505), 1.08883))]
    f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in xyz]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def test_a_plug_ins_colour_stands_apart_from_every_other_line() -> None:
    """A walk found a plug-in's light pink beside the recompute baseline's salmon, their curves crossing."""
    from kvlab.viz.colours import OTHER_COLOURS, POLICY_COLOURS

    def distance(a: str, b: str) -> float:
        return sum((p - q) ** 2 for p, q in zip(_lab(a), _lab(b))) ** 0.5

    named = min(distance(o, c) for o in OTHER_COLOURS for c in POLICY_COLOURS.values())
    others = min(distance(a, b) for i, a in enumerate(OTHER_COLOURS) for b in OTHER_COLOURS[i + 1 :])
    assert named >= 25 and others >= 25, (named, others)


def test_every_turn_of_a_long_conversation_has_its_legend_entry_and_a_colour_apart() -> None:
    """A walk found turns 9 and 10 clipped off a 12-turn map's legend, and turn 11 in turn 1's colour."""
    from kvlab.viz.chat import TURN_COLOURS

    def distance(a: str, b: str) -> float:
        return sum((p - q) ** 2 for p, q in zip(_lab(a), _lab(b))) ** 0.5

    assert len(TURN_COLOURS) == 20
    assert min(distance(a, b) for i, a in enumerate(TURN_COLOURS) for b in TURN_COLOURS[i + 1:]) >= 25
    for n, repeats in ((12, False), (24, True)):
        segments = [{"start": 4 * t, "end": 4 * t + 4, "turn": t, "role": "user"} for t in range(n)]
        figure = retained_map([[list(range(4 * n))]], 4 * n, segments, "map")
        entries = [trace for trace in figure.data[1:]]
        assert [e.name for e in entries] == [f"turn {t + 1}" for t in range(n)]
        assert len({e.marker.color for e in entries}) == min(n, 20)
        # the legend's title above its entries, which then wrap in the chart's whole width
        assert figure.layout.legend.title.side == "top"
        assert ("colours repeat every 20 turns" in figure.layout.legend.title.text) is repeats
        animation = retained_animation([{"retained": [[list(range(4 * n))]], "total": 4 * n, "segments": segments}],
                                       "map")
        assert animation.layout.margin.t == 50 + 20 * (1 + -(-n // 8))  # room for every row of the legend
