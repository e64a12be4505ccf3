"""Sweeps: a sweep file's plan, each run trained once and recorded, runs on pinned workers."""
