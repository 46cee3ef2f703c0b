"""Configuration of an exported megamemo model (LaMemo, Transformer-XL, Transformer+RPE) for Hugging Face
transformers. Self-contained: this file is copied next to config.json by `megamemo export hf` and needs only
transformers, never megamemo. The fields are megamemo's model config (megamemo/model/config.py) under the same
names, plus `generation_mem_len`, the memory length used while generating one token at a time."""

from transformers import PretrainedConfig

VARIANTS = ("lamemo", "lamemo_xlrpe", "lamemo_no_interp", "lamemo_no_lookahead", "xl", "rpe")


class MegamemoConfig(PretrainedConfig):
    model_type = "megamemo"

    def __init__(
        self,
        variant="lamemo",
        n_token=256,
        n_layer=2,
        d_model=64,
        n_head=2,
        d_head=32,
        d_inner=128,
        dropout=0.1,
        dropatt=0.0,
        tgt_len=64,
        mem_len=64,
        clamp_len=-1,
        same_length=False,
        pre_lnorm=False,
        cutoffs=(),
        div_val=1,
        tie_weight=True,
        tie_projs=(False,),
        d_embed=None,
        generation_mem_len=None,
        n_vocab=None,
        **kwargs,
    ):
        if variant not in VARIANTS:
            raise ValueError(f"megamemo variant {variant!r} is not one of {', '.join(VARIANTS)}")
        self.variant, self.n_token, self.n_layer = variant, n_token, n_layer
        self.n_vocab = n_vocab  # a padded vocabulary's symbols (ids n_vocab .. n_token-1: padding); None: all
        self.d_model, self.n_head, self.d_head, self.d_inner = d_model, n_head, d_head, d_inner
        self.dropout, self.dropatt = dropout, dropatt
        self.tgt_len, self.mem_len, self.clamp_len = tgt_len, mem_len, clamp_len
        self.same_length, self.pre_lnorm = same_length, pre_lnorm
        self.cutoffs, self.div_val = list(cutoffs), div_val
        self.tie_weight, self.tie_projs, self.d_embed = tie_weight, list(tie_projs), d_embed
        # megamemo generate's default: a one-token segment sees as many past tokens as a training segment's last
        self.generation_mem_len = mem_len + tgt_len - 1 if generation_mem_len is None else generation_mem_len
        # the names generic transformers code reads
        self.vocab_size, self.hidden_size, self.num_hidden_layers = n_token, d_model, n_layer
        self.num_attention_heads = n_head
        kwargs.setdefault("tie_word_embeddings", False)  # tying is inside the model (the softmax reads the tables)
        super().__init__(**kwargs)

    @property
    def lamemo(self) -> bool:
        return self.variant.startswith("lamemo")

    @property
    def has_memory(self) -> bool:
        return self.variant != "rpe"
