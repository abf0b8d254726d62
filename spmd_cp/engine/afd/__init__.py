"""Attention-FFN disaggregation (--afd A:F): the attention ranks' engine and feed-forward
client, the FFN ranks' server and loads.
"""
