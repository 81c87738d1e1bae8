"""Test doubles shipped with relayd: the OJS emulator."""
