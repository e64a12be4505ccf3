"""configs/paper.py: the paper's config, its variants, and its fields apart from ours."""

from configs import default, paper


def test_paper_config_and_runlocal():
    config = paper.get_config()
    assert (config.model.n_layers, config.model.d_model, config.model.d_ff,
            config.model.n_heads, config.data.seq_len) == (48, 512, 1536, 4, 2048)
    assert config.data.source == "c4"
    local = paper.get_config("runlocal")
    assert local.data.source == "embedded" and local.model.d_model == 512


def test_paper_fields_and_ours_are_the_config_and_width48_keeps_the_default_recipe():
    config = paper.get_config()
    assert not set(paper.PAPER) & set(paper.OURS)
    for path, value in {**paper.PAPER, **paper.OURS}.items():
        section, field = path.split(".")
        assert config[section][field] == value, path
    width48, recipe = paper.get_config("width48"), default.get_config()
    assert (width48.model.n_layers, width48.model.d_model, width48.model.d_ff,
            width48.model.n_heads) == (48, 512, 1536, 4)
    assert (width48.data.seq_len, width48.data.batch_size) == (128, 8)
    for section in ("opt", "train", "diag"):
        assert width48[section].to_dict() == recipe[section].to_dict(), section
