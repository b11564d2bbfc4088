"""The MoE shapes of the paper's three models and the TP x EP layouts we evaluate.

Numbers are the published config.json values (hidden_size, moe_intermediate_size /
expert intermediate size, routed experts, experts per token). Stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int  # N
    expert_ffn: int  # F (K = F / expert-TP)
    experts: int  # E
    topk: int  # k
    default_splits: int  # L the paper uses for this model

    def local_experts(self, ep: int) -> int:
        if self.experts % ep:
            raise ValueError(f"EP={ep} does not divide the {self.experts} experts of {self.name}")
        return self.experts // ep

    def ffn_per_rank(self, tp: int) -> int:
        if self.expert_ffn % tp:
            raise ValueError(f"TP={tp} does not divide expert FFN {self.expert_ffn} of {self.name}")
        return self.expert_ffn // tp


MODELS = {
    "granite": MoEShape("Granite-3.1-1B-A400M", 1024, 512, 32, 8, 1),
    "qwen": MoEShape("Qwen1.5-MoE-A2.7B", 2048, 1408, 60, 4, 2),
    "deepseek": MoEShape("DeepSeek-V2-Lite", 2048, 1408, 64, 6, 2),
}

#: (TP, EP) layouts: the paper's three four-GPU layouts and the two that fit two GPUs.
LAYOUTS = {"TP4EP1": (4, 1), "TP2EP2": (2, 2), "TP1EP4": (1, 4), "TP2EP1": (2, 1), "TP1EP2": (1, 2)}

SEQUENCE_LENGTHS = (1024, 2048, 4096, 8192, 16384)
BATCH = 4
