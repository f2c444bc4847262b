"""The transmitter: hands messages for services of other broker instances to the transport.

It will read the `transmission` topic, order what it reads with `ksb.transmission` (priority, then
send order per conversation) and retransmit what the remote dispatcher has not acknowledged
(`ksb.sequencing.Retransmitter`). On a single instance nothing is ever written to `transmission`, so
the transmitter has no work yet: today it only runs the periodic timer, serves metrics and stops
cleanly. Cross-instance delivery is issue 5.
"""
