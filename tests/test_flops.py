"""The `python -m lipsformer.flops` command and its attention count."""
import json

from torch import nn

from lipsformer.flops import PAPER, count_flops, main


class _Attend(nn.Module):
    def forward(self, x):
        return nn.functional.scaled_dot_product_attention(x, x, x)


def test_sdpa_counts_as_its_two_matmuls():
    # (1, 2, 5, 4): q k^T is 2*5*5*4 multiply-adds, attn v another 2*5*5*4
    assert count_flops(_Attend(), (2, 5, 4)) == 2 * (2 * 5 * 5 * 4)


def test_command_lists_every_model_beside_the_paper(capsys, tmp_path):
    out_json = tmp_path / "flops.json"
    main(["--no-flops", "--json", str(out_json)])
    printed = capsys.readouterr().out
    for name in PAPER:
        assert name in printed
    rows = json.loads(out_json.read_text())
    cswin_t = next(r for r in rows if r["model"] == "lipsformer_cswin_t")
    assert cswin_t["paper_params_m"] == 24 and cswin_t["paper_gflops"] == 4.7 and cswin_t["paper_top1"] == 83.5
    assert abs(cswin_t["params_m"] - 23.77) < 0.01


def test_command_counts_flops_of_chosen_models(capsys):
    main(["--models", "lipsformer_cswin_t"])
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith("lipsformer_cswin_t"))
    assert "4.67" in line.split()


def test_models_without_a_name_is_a_mistake_not_an_empty_table(capsys):
    assert main(["--models"]) == 2
    captured = capsys.readouterr()
    assert "--models: expected at least one argument" in captured.err and "params (M)" not in captured.out
