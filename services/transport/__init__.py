"""The transport: the links to other broker instances.

It will deliver the transmitter's messages to the remote `inbound` topic, carry acknowledgements
back, and suppress unreachable destinations (`ksb.ticker.Suppression`). On a single instance there
is no remote destination, so the transport has no work yet: today it only runs the periodic timer,
serves metrics and stops cleanly. Cross-instance delivery is issue 5.
"""
