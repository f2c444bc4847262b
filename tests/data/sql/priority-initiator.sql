-- Service Broker documentation, "Conversation Priorities", the example's script for the
-- initiator endpoint, pasted unchanged (its misspelt LOCAL_SERVICE_NAME included).
USE InitiatorDB;
GO
CREATE BROKER PRIORITY InitiatorToTargetPriority
    FOR CONVERSATION
    SET (CONTRACT_NAME = SimpleContract,
         LOCAL_SERVICE_NAME = InitiatorSerivce,
         REMOTE_SERVICE_NAME = N'TargetService',
         PRIORITY_LEVEL = 3);
GO
