"""What verification and drafting cost on this hardware: the probe and the cost grid."""
