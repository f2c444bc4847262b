-- Service Broker documentation, "How to: Configure Permissions for a Local Service", the
-- example, pasted unchanged.
    USE AdventureWorks2008R2 ;
    GO

    -- This example sets permissions for a service
    -- program that sends messages to the Ordering service
    -- and receives messages from the StoreFrontQueue queue.

    -- Grant SEND permission on the service to the owner
    -- of the initiating service.
    GRANT SEND ON SERVICE::[Ordering]
    TO [BrokerApplicationUser] ;
    GO

    -- Grant RECEIVE permission on the queue.
    GRANT RECEIVE ON [StoreFrontQueue]
    TO [BrokerApplicationUser] ;
    GO
