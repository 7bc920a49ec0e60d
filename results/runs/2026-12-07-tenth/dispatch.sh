#!/bin/bash
# an H200: the acceptance rows first; any other GPU: the prefetch lead
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then bash results/runs/2026-12-07-tenth/h200/acc.sh; else bash results/runs/2026-12-07-tenth/call1/run1.sh; fi
