"""Test doubles shipped with relayd: the OJS emulator, a throwaway JetStream server."""
